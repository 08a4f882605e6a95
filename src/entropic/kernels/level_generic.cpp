// The generic level: plain C++ for the build's default target (x86-64's baseline, or the
// machine's own elsewhere); always built.
#define ENTROPIC_LEVEL_BUILT 1
#define ENTROPIC_LEVEL_NAME "generic"
#define ENTROPIC_LEVEL_GETTER kernels_generic
#include "level.h"
