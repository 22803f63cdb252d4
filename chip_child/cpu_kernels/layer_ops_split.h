// When a layer op (layer_ops.cpp, layer_ops_avx2.cpp) splits its rows over an OpenMP team. The
// decode step's team (step_team.h) runs only steps whose ops all stay on one thread, so that no
// OpenMP team spins beside it.
#pragma once
#include <stdint.h>

namespace l3 {

// Below this many elements one thread does it all. A decode step's 16 rows are past it: the ops
// run between projections whose thread team is still spinning, so splitting costs little, and
// silu's and rope's per-element work pays for it (a 16-row step of the 128M model, 0.96x the time).
constexpr int64_t PARALLEL_ELEMENTS = 1 << 12;

}  // namespace l3
