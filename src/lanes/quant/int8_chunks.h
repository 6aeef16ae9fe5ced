// How a row of a 32-value format is cut for the integer kernels (int8_layout.py writes the same order).
//
// Groups go in chunks of 16, then one each of 8, 4, 2, 1 for the rest (largest first). In a chunk of gc
// groups each group has L = 16 / gc lanes (8 for gc = 1, which leaves lanes 8-15 empty), and unit u (values
// 4u .. 4u+3) of group i sits in lane i*L + u%L of instruction u / L, so a chunk is max(1, gc / 2)
// instructions of 64 bytes (32 for gc = 1). 4-bit rows store the instructions' bytes as nibbles: a stream
// of 2H bytes (H = min(64, 16 gc)) is H packed bytes, the first H in the low nibbles.
#pragma once

#include <immintrin.h>
#include <cstdint>
#include <vector>

namespace lanes_quant {

constexpr int64_t kMostK = 65536;  // the widest row the integer kernels take (their scratch is on the stack)


struct Chunk {
  int64_t first = 0;          // the chunk's first group in the row
  int groups = 0;             // gc
  int lanes = 0;              // L: lanes a group
  int instructions = 0;       // vpdpbusd a chunk
  int64_t quant_offset = 0;   // where its bytes start in the row
  __mmask16 used = 0;         // lanes holding values
  __m512i spread;             // lane -> its group within the chunk
  __m512i units[8];           // instruction s's lanes -> their 4 values' unit (32 g + 4 u) / 4 in the chunk
};

struct Chunks {
  std::vector<Chunk> at;
  int64_t count = 0;
  int64_t scale_offset = 0;  // the row's f16 scales, one a group, after every chunk's bytes
  int64_t min_offset = 0;    // then (Q4_1) its f16 minimums

  static Chunks of(int64_t groups, bool nibbles) {
    Chunks out;
    int64_t first = 0, offset = 0;
    for (int size = 16; size >= 1;) {
      if (groups - first < size) {
        size /= 2;
        continue;
      }
      Chunk c;
      c.first = first;
      c.groups = size;
      c.lanes = size == 1 ? 8 : 16 / size;
      c.instructions = size == 1 ? 1 : size / 2;
      c.quant_offset = offset;
      c.used = static_cast<__mmask16>(size == 1 ? 0x00FF : 0xFFFF);
      alignas(64) int32_t spread[16], units[16];
      for (int l = 0; l < 16; ++l) spread[l] = size == 1 ? 0 : l / c.lanes;
      c.spread = _mm512_load_si512(spread);
      for (int s = 0; s < c.instructions; ++s) {
        for (int l = 0; l < 16; ++l) units[l] = size == 1 && l >= 8 ? 0 : l / c.lanes * 8 + s * c.lanes + l % c.lanes;
        c.units[s] = _mm512_load_si512(units);
      }
      out.at.push_back(c);
      first += size;
      offset += (nibbles ? 16 : 32) * size;
      if (size < 16) size /= 2;  // one chunk of each smaller size at most
    }
    out.count = static_cast<int64_t>(out.at.size());
    out.scale_offset = offset;
    out.min_offset = offset + 2 * groups;
    return out;
  }
};

}  // namespace lanes_quant
