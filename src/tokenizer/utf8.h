// UTF-8 helpers of the tokenizers: lossy decoding of byte strings, and where a string's last
// character is still unfinished.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace bitdelta::utf8 {

// Appends `bytes` to `out` as valid UTF-8: each maximal invalid subpart (a byte that cannot start a
// character, or the bytes of a sequence cut short) becomes one U+FFFD, as Python's
// decode("utf-8", "replace") and Rust's from_utf8_lossy do (Unicode's "substitution of maximal
// subparts"), so a cut between characters does not change the result.
void append_lossy(std::string& out, std::string_view bytes);
inline std::string lossy(std::string_view bytes) {
  std::string out;
  append_lossy(out, bytes);
  return out;
}

// Length of the UTF-8 sequence a byte starts: 1 for ASCII, continuation and invalid lead bytes.
size_t sequence_length(uint8_t lead);

// Bytes at the end of `s` that start a character the next bytes might still complete (0 to 3).
size_t unfinished_suffix(std::string_view s);

// The code point at s[i] (valid UTF-8 assumed) and its length in bytes.
char32_t decode_at(std::string_view s, size_t i, size_t* length);

}  // namespace bitdelta::utf8
