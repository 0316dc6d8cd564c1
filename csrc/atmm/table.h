// The tiling table: shape key (128 bits) -> compiled configuration, with nearest-key fallback.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "atmm/atmm.h"

namespace atmm {

// The shape a lookup is keyed by. `width` is d_in for shrink and d_out for expand; `rank` is the
// largest padded rank in the call; tokens and segments are bucketed (see bucket_*).
struct ShapeKey {
  Direction direction;
  DType dtype;
  int64_t tokens;
  int width;
  int rank;
  int segments;
};

struct Key128 {
  uint64_t hi, lo;
  bool operator==(Key128 const& o) const { return hi == o.hi && lo == o.lo; }
};
struct Key128Hash {
  size_t operator()(Key128 const& k) const { return size_t(k.hi * 0x9E3779B97F4A7C15ull ^ (k.lo + 0x7F4A7C159E3779B9ull + (k.hi << 6))); }
};

int64_t bucket_tokens(int64_t tokens);  // multiples of 32, as the tuner enumerates them
int bucket_segments(int segments);      // next power of two
Key128 pack_key(ShapeKey const& k);     // after bucketing

struct TableEntry {
  ShapeKey key;  // bucketed
  int config;    // index into kernel_configs()
  int split_k;   // shrink only; 1 for expand
};

struct LookupResult {
  int config;
  int split_k;
  bool exact;
  bool from_default;
  ShapeKey matched;
};

class TilingTable {
 public:
  // Adds an entry; throws std::invalid_argument naming the entry when its configuration is not
  // compiled for its direction and dtype, or when a field is out of range.
  void add(ShapeKey key, std::string const& config, int split_k);
  LookupResult lookup(ShapeKey key) const;
  size_t size() const { return entries_.size(); }
  std::vector<TableEntry> const& entries() const { return entries_; }
  // The rule that serves before any table is tuned (and when a direction/dtype has no entry).
  static LookupResult default_choice(ShapeKey const& key);

 private:
  std::unordered_map<Key128, size_t, Key128Hash> index_;
  std::vector<TableEntry> entries_;
};

}  // namespace atmm
