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
  const bool r64 = key.rank <= 64, r128 = key.rank <= 128;
  if (key.direction == Direction::kShrink) {
    // From the H100 measurements (csrc/atmm/NOTES.md): up to a few hundred tokens the stream
    // shrink on 16-row tiles (split d_in so that about two waves of blocks stream lora_A); longer
    // batches the CUTLASS 64x64 tile, which measured best there for every rank up to 128.
    const bool few = key.tokens <= 512 && r128;
    r.config = find_config(few ? (r64 ? "xs_m16_r64_w1x4" : "xs_m16_r128_w1x4") : "t64x64_k64_s5");
    const int64_t tile_m = few ? 16 : 64;
    const int64_t m_tiles = key.tokens / tile_m + key.segments;
    const int64_t want_blocks = few ? 264 : 132;
    int split = 1;
    while (split < 32 && m_tiles * split < want_blocks && key.width / (split * 2) >= 128) split *= 2;
    r.split_k = split;
  } else {
    // Stream expands (v in registers, y and lora_B streamed in chunks): 16-row tiles for decode-like
    // batches, wide chunks below 4k tokens, larger row tiles above; CUTLASS past rank 128.
    if (key.tokens <= 512 && r128)
      r.config = find_config(r64 ? "ye_m16n128_r64_w1x4" : "ye_m32n128_r128_w1x8");
    else if (r64)
      r.config = find_config(key.tokens <= 4096 ? "ye_m64n256_r64_w1x8" : "ye_m128n128_r64_w2x4");
    else if (r128)
      r.config = find_config(key.tokens <= 4096 ? "ye_m64n64_r128_w2x4" : "ye_m128n64_r128_w2x4");
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
    if (kernel_configs()[e.config].serves_rank(key.rank)) return LookupResult{e.config, e.split_k, true, false, e.key};
  }
  // Nearest key of the same direction and dtype whose config serves this rank: distance in log2
  // space, widths weigh most.
  double best = std::numeric_limits<double>::infinity();
  TableEntry const* pick = nullptr;
  for (TableEntry const& e : entries_) {
    if (e.key.direction != b.direction || e.key.dtype != b.dtype) continue;
    if (!kernel_configs()[e.config].serves_rank(key.rank)) continue;
    double d = 4.0 * l2(e.key.width, b.width) + 2.0 * l2(e.key.tokens, b.tokens) + 1.0 * l2(e.key.rank, b.rank) +
               1.0 * l2(e.key.segments, b.segments);
    if (d < best) {
      best = d;
      pick = &e;
    }
  }
  if (!pick) return default_choice(key);
  return LookupResult{pick->config, pick->split_k, false, false, pick->key};
}

}  // namespace atmm
