#pragma once
// Includes Catch2 v3 or v2, whichever the build found.
#ifdef TANDEM_CATCH3
#include <catch2/catch_all.hpp>
using Catch::Approx;
#else
#include <catch2/catch.hpp>
#endif
