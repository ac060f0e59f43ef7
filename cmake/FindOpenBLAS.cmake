# Finds OpenBLAS (the CBLAS interface). Prefers OpenBLAS's own CMake config when present.
# Defines OpenBLAS::OpenBLAS.
find_path(OpenBLAS_INCLUDE_DIR cblas.h
  HINTS $ENV{OpenBLAS_HOME}
  PATH_SUFFIXES include include/openblas include/x86_64-linux-gnu/openblas-pthread include/x86_64-linux-gnu)
find_library(OpenBLAS_LIBRARY NAMES openblas
  HINTS $ENV{OpenBLAS_HOME}
  PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu/openblas-pthread)
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(OpenBLAS DEFAULT_MSG OpenBLAS_LIBRARY OpenBLAS_INCLUDE_DIR)
if(OpenBLAS_FOUND AND NOT TARGET OpenBLAS::OpenBLAS)
  add_library(OpenBLAS::OpenBLAS UNKNOWN IMPORTED)
  set_target_properties(OpenBLAS::OpenBLAS PROPERTIES
    IMPORTED_LOCATION "${OpenBLAS_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${OpenBLAS_INCLUDE_DIR}")
endif()
mark_as_advanced(OpenBLAS_INCLUDE_DIR OpenBLAS_LIBRARY)
