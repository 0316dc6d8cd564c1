// Phase-selectable forward, used by the tuner to time the shrink and the expand apart.
#pragma once

#include <string>

#include "atmm/atmm.h"

namespace atmm {

enum Phase : int { kPhasePrep = 1, kPhaseShrink = 2, kPhaseExpand = 4, kPhaseAll = 7 };

// Like forward(), running only the phases in `phases` (kPhaseShrink includes the split-K reduce).
// Running a later phase alone reuses the metadata and intermediates the last full call left in the
// same workspace.
std::string forward_phases(ForwardArgs const& a, int phases, cudaStream_t stream);

}  // namespace atmm
