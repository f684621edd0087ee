#include "tokenizer/bpe.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <nlohmann/json.hpp>
#include <queue>

#include "bitdelta/checkpoint.h"
#include "bitdelta/error.h"
#include "tokenizer/utf8.h"

namespace bitdelta {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// GPT-2's pre-tokenizer pattern, what a ByteLevel step with use_regex splits by.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// GPT-2's map of bytes to printable characters: the printable Latin-1 bytes stand for themselves,
// the other 68 for U+0100 onwards in byte order. Token spellings are written in these characters.
std::array<char32_t, 256> byte_characters() {
  std::array<char32_t, 256> out{};
  char32_t extra = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    out[size_t(b)] = printable ? char32_t(b) : 256 + extra++;
  }
  return out;
}

void append_code_point(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += char(c);
  } else if (c < 0x800) {
    out += char(0xC0 | (c >> 6));
    out += char(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += char(0xE0 | (c >> 12));
    out += char(0x80 | ((c >> 6) & 0x3F));
    out += char(0x80 | (c & 0x3F));
  } else {
    out += char(0xF0 | (c >> 18));
    out += char(0x80 | ((c >> 12) & 0x3F));
    out += char(0x80 | ((c >> 6) & 0x3F));
    out += char(0x80 | (c & 0x3F));
  }
}

// Unicode White_Space: what an added token's lstrip / rstrip take beside it.
bool white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

struct RegexDeleter {
  void operator()(pcre2_code* c) const { pcre2_code_free(c); }
};
struct MatchDataDeleter {
  void operator()(pcre2_match_data* d) const { pcre2_match_data_free(d); }
};

}  // namespace

// One pre-tokenizer step. Each cuts every piece so far into smaller ones.
struct ByteLevelBpe::Step {
  std::shared_ptr<pcre2_code> regex;  // the pieces are its matches and the text between them
  bool add_prefix_space = false;      // ByteLevel: a piece not starting with a space gets one
  bool byte_level = false;
};

ByteLevelBpe::~ByteLevelBpe() = default;
ByteLevelBpe::ByteLevelBpe(ByteLevelBpe&&) noexcept = default;
ByteLevelBpe& ByteLevelBpe::operator=(ByteLevelBpe&&) noexcept = default;

// Reads the fields of one tokenizer.json, naming the file and the field in every error.
struct ByteLevelBpe::Reader {
  std::string src;

  std::string type_of(const json& v, const std::string& field) const {
    if (!v.is_object() || !v.contains("type") || !v["type"].is_string())
      fail(src, ": ", field, " must be an object with a type");
    return v["type"].get<std::string>();
  }
  bool flag(const json& v, const char* key, bool fallback, const std::string& field) const {
    if (!v.contains(key) || v[key].is_null()) return fallback;
    if (!v[key].is_boolean()) fail(src, ": ", field, ".", key, " must be a boolean");
    return v[key].get<bool>();
  }
  int32_t id(const json& v, const std::string& field) const {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > (1 << 24))
      fail(src, ": ", field, " must be a token id (an integer from 0 to 2^24), got ", v.dump());
    return int32_t(v.get<int64_t>());
  }
  const json& list(const json& v, const char* key, const std::string& field) const {
    if (!v.contains(key) || !v[key].is_array()) fail(src, ": ", field, ".", key, " must be a list");
    return v[key];
  }
  std::shared_ptr<pcre2_code> regex(const std::string& pattern, const std::string& field) const {
    int code = 0;
    PCRE2_SIZE offset = 0;
    pcre2_code* re = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP, &code, &offset, nullptr);
    if (!re) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(code, message, sizeof message);
      fail(src, ": ", field, " pattern does not compile at offset ", offset, ": ",
           reinterpret_cast<const char*>(message));
    }
    return std::shared_ptr<pcre2_code>(re, RegexDeleter{});
  }
};

ByteLevelBpe::ByteLevelBpe(const fs::path& file) : file_(file) {
  const Reader r{file.string()};
  const json j = read_json_file(file);
  if (!j.is_object()) fail(r.src, ": not a JSON object");
  if (!j.contains("model") || !j["model"].is_object()) fail(r.src, ": missing field 'model'");
  read_model(r, j["model"]);
  if (j.contains("added_tokens") && !j["added_tokens"].is_null()) read_added(r, j["added_tokens"]);
  if (j.contains("normalizer")) check_normalizer(r, j["normalizer"], "normalizer");
  if (!j.contains("pre_tokenizer") || j["pre_tokenizer"].is_null())
    fail(r.src, ": pre_tokenizer is missing (a byte-level BPE has a ByteLevel pre-tokenizer)");
  read_pre_tokenizer(r, j["pre_tokenizer"], "pre_tokenizer");
  if (std::none_of(steps_.begin(), steps_.end(), [](const Step& s) { return s.byte_level; }))
    fail(r.src,
         ": pre_tokenizer has no ByteLevel step: not a byte-level BPE (only those are "
         "supported)");
  // Decoder: ByteLevel (the bytes of the tokens, read as UTF-8), which decode() does.
  if (j.contains("decoder") && !j["decoder"].is_null()) {
    const std::string type = r.type_of(j["decoder"], "decoder");
    if (type != "ByteLevel")
      fail(r.src, ": decoder type '", type, "' is not supported (only ByteLevel)");
  }
  if (j.contains("post_processor")) read_post_processor(r, j["post_processor"], "post_processor");
}

ByteLevelBpe::Token& ByteLevelBpe::token(int32_t id) {
  if (size_t(id) >= tokens_.size()) tokens_.resize(size_t(id) + 1);
  return tokens_[size_t(id)];
}

// The model: a byte-level BPE (no byte fallback, no word prefixes or suffixes): its vocabulary,
// a token for each of the 256 bytes, and the merges.
void ByteLevelBpe::read_model(const Reader& r, const json& model) {
  if (model.contains("type") && model["type"] != "BPE")
    fail(r.src, ": model.type ", model["type"].dump(), " is not supported (only BPE)");
  if (r.flag(model, "byte_fallback", false, "model"))
    fail(r.src,
         ": model.byte_fallback is set: a SentencePiece-style BPE, which needs the "
         "checkpoint's tokenizer.model");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (model.contains(key) && model[key].is_string() && !model[key].get<std::string>().empty())
      fail(r.src, ": model.", key, " is not supported");
  if (model.contains("dropout") && model["dropout"].is_number() &&
      model["dropout"].get<double>() > 0)
    fail(r.src, ": model.dropout is not supported (it makes encoding random)");
  ignore_merges_ = r.flag(model, "ignore_merges", false, "model");
  if (!model.contains("vocab") || !model["vocab"].is_object())
    fail(r.src, ": model.vocab must be an object of token -> id");

  const auto chars = byte_characters();
  std::unordered_map<char32_t, uint8_t> char_byte;
  for (int b = 0; b < 256; ++b) char_byte[chars[size_t(b)]] = uint8_t(b);
  for (const auto& [spelling, value] : model["vocab"].items()) {
    const int32_t id = r.id(value, "model.vocab[\"" + spelling + "\"]");
    Token& t = token(id);
    if (!t.unused) fail(r.src, ": model.vocab gives id ", id, " to two tokens");
    t.unused = false;
    t.spelling = spelling;
    // The bytes: each character of the spelling is one byte of GPT-2's alphabet. A spelling with
    // other characters stands for its own UTF-8 (as added tokens do).
    for (size_t i = 0, len = 0; i < spelling.size(); i += len) {
      const auto it = char_byte.find(utf8::decode_at(spelling, i, &len));
      if (it == char_byte.end()) {
        t.bytes = spelling;
        break;
      }
      t.bytes += char(it->second);
    }
    vocab_.emplace(spelling, id);
  }
  for (int b = 0; b < 256; ++b) {
    std::string spelling;
    append_code_point(spelling, chars[size_t(b)]);
    const auto it = vocab_.find(spelling);
    if (it == vocab_.end())
      fail(r.src, ": model.vocab has no token for byte ", b,
           " (a byte-level BPE has one for each of the 256)");
    byte_ids_[b] = it->second;
  }

  // Merges: "left right" strings, or [left, right] pairs in newer files; rank = position.
  const json& merges = r.list(model, "merges", "model");
  merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const json& m = merges[rank];
    std::string left, right;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
        fail(r.src, ": model.merges[", rank, "] must be two tokens separated by one space, got ",
             m.dump());
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      fail(r.src, ": model.merges[", rank, "] must be \"left right\" or [left, right], got ",
           m.dump());
    }
    const auto a = vocab_.find(left), b = vocab_.find(right), c = vocab_.find(left + right);
    if (a == vocab_.end() || b == vocab_.end() || c == vocab_.end())
      fail(r.src, ": model.merges[", rank, "] (", m.dump(),
           ") names a token that is not in model.vocab");
    // A repeated pair keeps its first (lowest) rank.
    merges_.emplace(pair_key(a->second, b->second), Merge{uint32_t(rank), c->second});
  }
}

// Added tokens: matched in the text before anything else; special ones decode to nothing.
// Their ids are the ones the tokenizers library gives them when it reads the file, which are not
// always the file's: a token model.vocab holds keeps its vocabulary id; any other gets the
// vocabulary's size, or the largest added id + 1 once that is past it; a repeated content is
// skipped. The file's ids agree in released checkpoints; where they do not, ours agree with
// tokenizers (the ids the model was trained on), as the session-45 check against it showed.
void ByteLevelBpe::read_added(const Reader& r, const json& added) {
  if (!added.is_array()) fail(r.src, ": added_tokens must be a list");
  const int64_t vocab_count = int64_t(vocab_.size());
  int64_t largest = -1;  // the largest id given to an added token so far
  for (size_t i = 0; i < added.size(); ++i) {
    const std::string field = str("added_tokens[", i, "]");
    const json& a = added[i];
    if (!a.is_object() || !a.contains("content") || !a["content"].is_string() ||
        a["content"].get<std::string>().empty())
      fail(r.src, ": ", field, " must be an object with a non-empty content");
    if (!a.contains("id")) fail(r.src, ": ", field, " has no id");
    r.id(a["id"], field + ".id");  // read as tokenizers reads it, then given as it gives it
    const std::string content = a["content"].get<std::string>();
    if (utf8::lossy(content) != content) fail(r.src, ": ", field, ".content is not valid UTF-8");
    if (std::any_of(added_.begin(), added_.end(),
                    [&](const Added& x) { return x.content == content; }))
      continue;
    int32_t id;
    if (const auto in_vocab = vocab_.find(content); in_vocab != vocab_.end()) {
      id = in_vocab->second;
    } else {
      id = int32_t(std::max(largest + 1, vocab_count));
      if (id > (1 << 24)) fail(r.src, ": ", field, " would get id ", id, ", past 2^24");
    }
    largest = std::max<int64_t>(largest, id);
    Token& t = token(id);
    t.unused = false;
    t.spelling = content;
    t.special = r.flag(a, "special", false, field);
    t.bytes = t.special ? std::string() : content;
    if (r.flag(a, "single_word", false, field))
      fail(r.src, ": ", field, ".single_word is not supported");
    added_.push_back(
        {content, id, r.flag(a, "lstrip", false, field), r.flag(a, "rstrip", false, field)});
  }
  std::stable_sort(added_.begin(), added_.end(), [](const Added& x, const Added& y) {
    return x.content.size() > y.content.size();
  });
  for (const Added& a : added_) added_first_[uint8_t(a.content[0])] = true;
}

// Normalizer: none, or NFC. NFC is taken as already true of the text: text that is not in NFC
// (decomposed accents) may encode differently from the tokenizers library.
void ByteLevelBpe::check_normalizer(const Reader& r, const json& n, const std::string& field) {
  if (n.is_null()) return;
  const std::string type = r.type_of(n, field);
  if (type == "NFC") return;
  if (type == "Sequence") {
    const json& all = r.list(n, "normalizers", field);
    for (size_t i = 0; i < all.size(); ++i)
      check_normalizer(r, all[i], str(field, ".normalizers[", i, "]"));
    return;
  }
  fail(r.src, ": ", field, " type '", type, "' is not supported (only NFC)");
}

// Pre-tokenizer: Split (a regex or a string, Isolated), Digits, ByteLevel, or a Sequence of them.
void ByteLevelBpe::read_pre_tokenizer(const Reader& r, const json& p, const std::string& field) {
  const std::string type = r.type_of(p, field);
  if (type == "Sequence") {
    const json& all = r.list(p, "pretokenizers", field);
    for (size_t i = 0; i < all.size(); ++i)
      read_pre_tokenizer(r, all[i], str(field, ".pretokenizers[", i, "]"));
  } else if (type == "Split") {
    const std::string behavior = p.value("behavior", "");
    if (behavior != "Isolated")
      fail(r.src, ": ", field, ".behavior '", behavior, "' is not supported (only Isolated)");
    if (r.flag(p, "invert", false, field)) fail(r.src, ": ", field, ".invert is not supported");
    const json& pattern = p.contains("pattern") ? p["pattern"] : json();
    if (pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string())
      steps_.push_back({r.regex(pattern["Regex"].get<std::string>(), field)});
    else if (pattern.is_object() && pattern.contains("String") && pattern["String"].is_string())
      steps_.push_back({r.regex("\\Q" + pattern["String"].get<std::string>() + "\\E", field)});
    else
      fail(r.src, ": ", field, ".pattern must be {\"Regex\": ...} or {\"String\": ...}");
  } else if (type == "Digits") {
    const bool each = r.flag(p, "individual_digits", false, field);
    steps_.push_back({r.regex(each ? "\\p{N}" : "\\p{N}+", field)});
  } else if (type == "ByteLevel") {
    steps_.push_back({r.flag(p, "use_regex", true, field) ? r.regex(kGpt2Pattern, field) : nullptr,
                      r.flag(p, "add_prefix_space", true, field), true});
  } else {
    fail(r.src, ": ", field, " type '", type,
         "' is not supported (only ByteLevel, Split, Digits and Sequence of them)");
  }
}

// Post-processor: the special tokens its template puts before the text.
void ByteLevelBpe::read_post_processor(const Reader& r, const json& p, const std::string& field) {
  if (p.is_null()) return;
  const std::string type = r.type_of(p, field);
  if (type == "ByteLevel") return;
  if (type == "Sequence") {
    const json& all = r.list(p, "processors", field);
    for (size_t i = 0; i < all.size(); ++i)
      read_post_processor(r, all[i], str(field, ".processors[", i, "]"));
    return;
  }
  if (type != "TemplateProcessing")
    fail(r.src, ": ", field, " type '", type,
         "' is not supported (only TemplateProcessing, ByteLevel and Sequence of them)");
  bool text_seen = false;
  for (const json& item : r.list(p, "single", field)) {
    if (item.is_object() && item.contains("Sequence")) {
      text_seen = true;
      continue;
    }
    if (!item.is_object() || !item.contains("SpecialToken") || !item["SpecialToken"].is_object())
      fail(r.src, ": ", field, ".single holds ", item.dump(), ", not a SpecialToken or Sequence");
    if (text_seen)
      fail(r.src, ": ", field, ".single puts a special token after the text: not supported");
    const std::string name = item["SpecialToken"].value("id", "");
    const json& specials = p.contains("special_tokens") ? p["special_tokens"] : json();
    if (!specials.is_object() || !specials.contains(name) || !specials[name].contains("ids") ||
        !specials[name]["ids"].is_array())
      fail(r.src, ": ", field, ".special_tokens has no ids for '", name, "'");
    for (const json& id : specials[name]["ids"]) {
      const int32_t v = r.id(id, field + ".special_tokens[\"" + name + "\"].ids");
      if (size_t(v) >= tokens_.size() || tokens_[size_t(v)].unused)
        fail(r.src, ": ", field, ".special_tokens gives '", name, "' id ", v,
             ", which no token has");
      prefix_.push_back(v);
    }
  }
}

void ByteLevelBpe::pre_tokenize(std::string_view text, std::vector<std::string>& words) const {
  std::vector<std::string> pieces{std::string(text)}, next;
  std::unique_ptr<pcre2_match_data, MatchDataDeleter> match;
  for (const Step& step : steps_) {
    next.clear();
    if (step.regex) {  // one match block for all the pieces of this step
      match.reset(pcre2_match_data_create_from_pattern(step.regex.get(), nullptr));
      if (!match) throw std::bad_alloc();
    }
    for (std::string& piece : pieces) {
      if (step.add_prefix_space && piece[0] != ' ') piece.insert(piece.begin(), ' ');
      if (!step.regex) {
        next.push_back(std::move(piece));
        continue;
      }
      // The matches, and the text between them, in order (behavior Isolated).
      size_t at = 0, last = 0;
      while (at < piece.size()) {
        const int rc = pcre2_match(step.regex.get(), reinterpret_cast<PCRE2_SPTR>(piece.data()),
                                   piece.size(), at, PCRE2_NO_UTF_CHECK, match.get(), nullptr);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
          PCRE2_UCHAR message[256];
          pcre2_get_error_message(rc, message, sizeof message);
          fail(file_.string(), ": pre-tokenizer pattern failed on a text of ", piece.size(),
               " bytes: ", reinterpret_cast<const char*>(message));
        }
        const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(match.get());
        const size_t begin = ov[0], end = ov[1];
        if (end == begin) {  // an empty match cuts nothing: go on after the next character
          at = begin + utf8::sequence_length(uint8_t(piece[begin]));
          continue;
        }
        if (begin > last) next.push_back(piece.substr(last, begin - last));
        next.push_back(piece.substr(begin, end - begin));
        at = last = end;
      }
      if (last < piece.size()) next.push_back(piece.substr(last));
    }
    pieces.swap(next);
  }
  for (auto& p : pieces) words.push_back(std::move(p));
}

void ByteLevelBpe::merge_word(std::string_view word, std::vector<int32_t>& ids) const {
  if (word.empty()) return;
  if (ignore_merges_) {  // a word the vocabulary has whole is that token
    static const auto chars = byte_characters();
    std::string spelling;
    for (const char c : word) append_code_point(spelling, chars[uint8_t(c)]);
    if (const auto it = vocab_.find(spelling); it != vocab_.end()) {
      ids.push_back(it->second);
      return;
    }
  }
  const size_t n = word.size();
  std::vector<int32_t> sym(n);
  std::vector<size_t> prev(n), next(n);  // neighbours among the symbols left (n: none)
  for (size_t i = 0; i < n; ++i) {
    sym[i] = byte_ids_[uint8_t(word[i])];
    prev[i] = i == 0 ? n : i - 1;
    next[i] = i + 1;
  }
  // Candidate merges, lowest rank first, then leftmost; stale entries are skipped when popped.
  struct Candidate {
    uint32_t rank;
    size_t left;
    int32_t a, b;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : left > o.left;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  const auto consider = [&](size_t left) {
    if (left >= n || next[left] >= n) return;
    const int32_t a = sym[left], b = sym[next[left]];
    const auto it = merges_.find(pair_key(a, b));
    if (it != merges_.end()) queue.push({it->second.rank, left, a, b});
  };
  for (size_t i = 0; i + 1 < n; ++i) consider(i);
  std::vector<char> alive(n, 1);
  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    const size_t right = next[c.left];
    if (!alive[c.left] || right >= n || sym[c.left] != c.a || sym[right] != c.b) continue;
    sym[c.left] = merges_.at(pair_key(c.a, c.b)).result;
    alive[right] = 0;
    next[c.left] = next[right];
    if (next[right] < n) prev[next[right]] = c.left;
    if (prev[c.left] < n) consider(prev[c.left]);
    consider(c.left);
  }
  for (size_t i = 0; i < n; i = next[i]) ids.push_back(sym[i]);
}

std::vector<int32_t> ByteLevelBpe::encode(std::string_view text) const {
  const std::string s = utf8::lossy(text);
  std::vector<int32_t> ids;
  std::vector<std::string> words;
  const auto encode_piece = [&](size_t begin, size_t end) {
    if (end <= begin) return;
    words.clear();
    pre_tokenize(std::string_view(s).substr(begin, end - begin), words);
    for (const auto& w : words) merge_word(w, ids);
  };
  // Added tokens first: at each position the longest one that matches (leftmost, longest).
  size_t start = 0;
  for (size_t i = 0; i < s.size();) {
    const Added* hit = nullptr;
    if (added_first_[uint8_t(s[i])])
      for (const Added& a : added_)
        if (s.compare(i, a.content.size(), a.content) == 0) {
          hit = &a;  // longest first
          break;
        }
    if (!hit) {
      ++i;
      continue;
    }
    size_t begin = i, end = i + hit->content.size(), len = 0;
    if (hit->lstrip)
      while (begin > start) {
        size_t b = begin - 1;
        while (b > start && (uint8_t(s[b]) & 0xC0) == 0x80) --b;
        if (!white_space(utf8::decode_at(s, b, &len))) break;
        begin = b;
      }
    if (hit->rstrip)
      while (end < s.size() && white_space(utf8::decode_at(s, end, &len))) end += len;
    encode_piece(start, begin);
    ids.push_back(hit->id);
    start = i = end;
  }
  encode_piece(start, s.size());
  return ids;
}

}  // namespace bitdelta
