#include "atmm/table.h"

#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace atmm {

int64_t bucket_tokens(int64_t tokens) { return tokens <= 0 ? 0 : (tokens + 31) / 32 * 32; }

int bucket_segments(int segments) {
  int b = 1;
  while (b < segments) b <<= 1;
  return b;
}

Key128 pack_key(ShapeKey const& k) {
  // hi: direction (8 bits) | dtype (8) | segments bucket (16) | token bucket (32)
  // lo: width (32) | rank (32)
  Key128 out;
  out.hi = (uint64_t(int(k.direction)) & 0xff) << 56 | (uint64_t(int(k.dtype)) & 0xff) << 48 |
           (uint64_t(bucket_segments(k.segments)) & 0xffff) << 32 | (uint64_t(bucket_tokens(k.tokens)) & 0xffffffffull);
  out.lo = uint64_t(uint32_t(k.width)) << 32 | uint64_t(uint32_t(k.rank));
  return out;
}

namespace {
ShapeKey bucketed(ShapeKey k) {
  k.tokens = bucket_tokens(k.tokens);
  k.segments = bucket_segments(k.segments);
  return k;
}

std::string describe(ShapeKey const& k) {
  std::ostringstream s;
  s << "{direction=" << direction_name(k.direction) << ", dtype=" << dtype_name(k.dtype) << ", tokens=" << k.tokens
    << ", width=" << k.width << ", rank=" << k.rank << ", segments=" << k.segments << "}";
  return s.str();
}

double l2(double a, double b) { return std::fabs(std::log2(std::max(a, 1.0)) - std::log2(std::max(b, 1.0))); }
}  // namespace

void TilingTable::add(ShapeKey key, std::string const& config, int split_k) {
  key = bucketed(key);
  int idx = find_config(config);
  if (idx < 0)
    throw std::invalid_argument("tiling table entry " + describe(key) + " names config '" + config + "', which is not compiled");
  if (!kernel_configs()[idx].serves(key.direction, key.dtype))
    throw std::invalid_argument("tiling table entry " + describe(key) + " names config '" + config + "', which is not built for " +
                                direction_name(key.direction));
  if (split_k < 1 || split_k > 64 || (key.direction == Direction::kExpand && split_k != 1))
    throw std::invalid_argument("tiling table entry " + describe(key) + " has split_k=" + std::to_string(split_k) +
                                " (shrink: 1..64, expand: 1)");
  if (key.width <= 0 || key.rank <= 0 || key.tokens <= 0)
    throw std::invalid_argument("tiling table entry " + describe(key) + " has a non-positive field");
  Key128 k = pack_key(key);
  auto it = index_.find(k);
  if (it != index_.end()) {
    entries_[it->second] = TableEntry{key, idx, split_k};
    return;
  }
  index_.emplace(k, entries_.size());
  entries_.push_back(TableEntry{key, idx, split_k});
}

LookupResult TilingTable::default_choice(ShapeKey const& key) {
  LookupResult r{};
  r.from_default = true;
  r.exact = false;
  r.matched = bucketed(key);
  if (key.direction == Direction::kShrink) {
    // Few tokens per segment: the gemv kernel; otherwise the CUTLASS 64x64 tile, which measured
    // best for every rank up to 128 on the H100. Split d_in so that enough CTAs stream lora_A.
    r.config = find_config(key.tokens <= 2 * key.segments && key.tokens <= 256 ? "gemv_shrink" : "t64x64_k64_s5");
    int64_t m_tiles = key.tokens / 64 + key.segments;
    int split = 1;
    while (split < 16 && m_tiles * split < 132 && key.width / (split * 2) >= 256) split *= 2;
    r.split_k = split;
  } else {
    // From the H100 measurements (csrc/atmm/NOTES.md): the fused kernel (reduce + expand + scaled
    // update in one launch, ranks <= 128) wins up to a few hundred tokens, CUTLASS above.
    if (key.rank <= 128 && key.tokens <= 512)
      r.config = find_config("fx_m16n256");
    else
      r.config = find_config(key.tokens >= 4096 ? "t64x128_k32_s6" : "t128x128_k32_s4");
    r.split_k = 1;
  }
  return r;
}

LookupResult TilingTable::lookup(ShapeKey key) const {
  ShapeKey b = bucketed(key);
  auto it = index_.find(pack_key(b));
  if (it != index_.end()) {
    TableEntry const& e = entries_[it->second];
    if (!(rank_limited(kernel_configs()[e.config].kind) && key.rank > 128))
      return LookupResult{e.config, e.split_k, true, false, e.key};
  }
  // Nearest key of the same direction and dtype: distance in log2 space, widths weigh most.
  double best = std::numeric_limits<double>::infinity();
  TableEntry const* pick = nullptr;
  for (TableEntry const& e : entries_) {
    if (e.key.direction != b.direction || e.key.dtype != b.dtype) continue;
    double d = 4.0 * l2(e.key.width, b.width) + 2.0 * l2(e.key.tokens, b.tokens) + 1.0 * l2(e.key.rank, b.rank) +
               1.0 * l2(e.key.segments, b.segments);
    if (d < best) {
      best = d;
      pick = &e;
    }
  }
  if (!pick) return default_choice(key);
  if (rank_limited(kernel_configs()[pick->config].kind) && key.rank > 128) return default_choice(key);
  return LookupResult{pick->config, pick->split_k, false, false, pick->key};
}

}  // namespace atmm
