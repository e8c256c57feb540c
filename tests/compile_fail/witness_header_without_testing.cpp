// Must not compile: the test-only witness factory refuses production builds.
#ifdef VRAM_CONTROL
#define VRAM_TESTING
#endif
#include "vram/testing/witness.hpp"
