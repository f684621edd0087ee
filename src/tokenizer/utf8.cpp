#include "tokenizer/utf8.h"

namespace bitdelta::utf8 {

namespace {
constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD
}

size_t sequence_length(uint8_t lead) {
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 1;
}

void append_lossy(std::string& out, std::string_view s) {
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const auto b = uint8_t(s[i]);
    if (b < 0x80) {
      out += char(b);
      ++i;
      continue;
    }
    const size_t len = sequence_length(b);
    if (len == 1) {  // a continuation byte or a byte no character starts with
      out += kReplacement;
      ++i;
      continue;
    }
    // The second byte's range excludes overlong forms, surrogates and code points past U+10FFFF.
    uint8_t lo = 0x80, hi = 0xBF;
    if (b == 0xE0) lo = 0xA0;
    if (b == 0xED) hi = 0x9F;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;
    size_t k = 1;  // bytes of the sequence that are right so far
    while (k < len && i + k < n) {
      const auto c = uint8_t(s[i + k]);
      const bool ok = k == 1 ? (c >= lo && c <= hi) : (c >= 0x80 && c <= 0xBF);
      if (!ok) break;
      ++k;
    }
    if (k == len) {
      out.append(s.substr(i, len));
    } else {
      out += kReplacement;  // the maximal subpart [i, i + k) stands for one replacement
    }
    i += k;
  }
}

size_t unfinished_suffix(std::string_view s) {
  const size_t n = s.size();
  for (size_t k = 1; k <= 3 && k <= n; ++k) {
    const auto b = uint8_t(s[n - k]);
    if ((b & 0xC0) == 0x80) continue;  // continuation: the lead is further back
    return sequence_length(b) > k ? k : 0;
  }
  return 0;
}

char32_t decode_at(std::string_view s, size_t i, size_t* length) {
  const auto b = uint8_t(s[i]);
  const size_t len = sequence_length(b);
  *length = len;
  if (len == 1) return b;
  char32_t cp = b & (0xFF >> (len + 1));
  for (size_t k = 1; k < len && i + k < s.size(); ++k) cp = (cp << 6) | (uint8_t(s[i + k]) & 0x3F);
  return cp;
}

}  // namespace bitdelta::utf8
