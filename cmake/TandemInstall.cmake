# tandem as a CMake package (included by the top-level CMakeLists.txt after the library).
#
#   cmake --install <build> --prefix <prefix> [--component tandem]
#
# installs, under <prefix>:
#   lib/libtandem.a                      the library (a shared one with -DBUILD_SHARED_LIBS=ON)
#   include/tandem/tandem.h              the umbrella header
#   include/tandem/{core,nn,...}/*.h     the headers, in the tree's layout
#   lib/cmake/tandem/                    tandemConfig.cmake, tandemConfigVersion.cmake, the
#                                        exported target tandem::tandem, the find modules
#   bin/tandem-run                       the launcher (tandem::tandem-run), with the examples
#   bin/{lenet,resnet,...,first_program} the example programs: component examples, which
#                                        --component tandem leaves out (examples/CMakeLists.txt)
# A consumer adds <prefix> to CMAKE_PREFIX_PATH and calls find_package(tandem). Both
# <prefix>/include and <prefix>/include/tandem are on tandem::tandem's include path, so
# `#include <tandem/tandem.h>` and the tree's own `#include "nn/nn.h"` both work.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(TANDEM_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/tandem)
set(TANDEM_INSTALL_INCLUDEDIR include/tandem)  # also in the top-level INSTALL_INTERFACE

install(TARGETS tandem EXPORT tandemTargets COMPONENT tandem
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY core kernels autograd nn data parallel
        DESTINATION ${TANDEM_INSTALL_INCLUDEDIR} COMPONENT tandem
        FILES_MATCHING PATTERN "*.h")
install(FILES include/tandem/tandem.h DESTINATION ${TANDEM_INSTALL_INCLUDEDIR} COMPONENT tandem)
install(EXPORT tandemTargets NAMESPACE tandem:: DESTINATION ${TANDEM_INSTALL_CMAKEDIR}
        COMPONENT tandem)

# What the config file needs to know of this build.
get_target_property(_tandem_type tandem TYPE)
if(_tandem_type STREQUAL "STATIC_LIBRARY")
  set(TANDEM_PACKAGE_STATIC ON)
else()
  set(TANDEM_PACKAGE_STATIC OFF)
endif()
if(TANDEM_WITH_CUDA AND NCCL_FOUND)
  set(TANDEM_PACKAGE_WITH_NCCL ON)
else()
  set(TANDEM_PACKAGE_WITH_NCCL OFF)
endif()
configure_package_config_file(cmake/tandemConfig.cmake.in
                              ${CMAKE_CURRENT_BINARY_DIR}/tandemConfig.cmake
                              INSTALL_DESTINATION ${TANDEM_INSTALL_CMAKEDIR})
# 0.x: a new minor version may break the API, so only the same minor version is compatible.
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/tandemConfigVersion.cmake
                                 VERSION ${tandem_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/tandemConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/tandemConfigVersion.cmake
              cmake/FindOpenBLAS.cmake cmake/FindCUDNN.cmake cmake/FindNCCL.cmake
        DESTINATION ${TANDEM_INSTALL_CMAKEDIR} COMPONENT tandem)
unset(_tandem_type)
