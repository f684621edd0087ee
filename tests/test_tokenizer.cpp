// Tokenizer against the Python sentencepiece fixture of the demo family, its BOS/EOS configuration,
// and the streaming detokenizer against whole-sequence decoding. The byte-level BPE
// (tokenizer.json) against the cases of tools/bpe_fixture/make_fixture.py, and its errors.
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bitdelta/error.h"
#include "bitdelta/tokenizer.h"
#include "test_util.h"

namespace bitdelta {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::TempDir;
using test::write_text;

const fs::path kSourceDir = BITDELTA_SOURCE_DIR;
const fs::path kDemoBase = kSourceDir / "models/demo/base";
const fs::path kFixture = kSourceDir / "tests/fixtures/reference/tokenizer_cases.json";

// The demo family is committed (tools/demo_family/train.py builds it); skip only without it.
#define REQUIRE_DEMO_TOKENIZER()                                                      \
  do {                                                                                \
    if (!fs::exists(kDemoBase / "tokenizer.model"))                                   \
      GTEST_SKIP() << (kDemoBase / "tokenizer.model").string() << " is missing (run " \
                   << "tools/demo_family/train.py and commit models/demo)";           \
  } while (false)

const Tokenizer& demo_tokenizer() {
  static const Tokenizer tokenizer(kDemoBase);
  return tokenizer;
}

// Strict UTF-8 check: every character complete, no overlong forms, surrogates or values > U+10FFFF.
bool valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<uint8_t>(s[i]);
    size_t n = 0;
    uint32_t cp = 0, min = 0;
    if (b < 0x80) {
      ++i;
      continue;
    } else if ((b & 0xE0) == 0xC0) {
      n = 2, cp = b & 0x1F, min = 0x80;
    } else if ((b & 0xF0) == 0xE0) {
      n = 3, cp = b & 0x0F, min = 0x800;
    } else if ((b & 0xF8) == 0xF0) {
      n = 4, cp = b & 0x07, min = 0x10000;
    } else {
      return false;
    }
    if (i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      const auto c = static_cast<uint8_t>(s[i + k]);
      if ((c & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (c & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n;
  }
  return true;
}

// Streams `ids` through a StreamDecoder, checking each piece as it comes; returns the whole text.
std::string stream(const Tokenizer& tok, std::span<const int32_t> ids) {
  StreamDecoder decoder(tok);
  const std::string whole = tok.decode(ids);
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    const std::string piece = decoder.push(ids[i]);
    EXPECT_TRUE(valid_utf8(piece)) << "piece after token " << i << " splits a character";
    text += piece;
    EXPECT_EQ(whole.compare(0, text.size(), text), 0)
        << "streamed text is not a prefix after token " << i;
  }
  text += decoder.finish();
  return text;
}

bool is_byte_piece(const std::string& p) {
  return p.size() == 6 && p.starts_with("<0x") && p.back() == '>';
}

// The id of the byte-fallback piece <0xNN> of every byte.
std::vector<int32_t> byte_ids(const Tokenizer& tok) {
  std::vector<int32_t> ids(256, -1);
  for (int32_t id = 0; id < static_cast<int32_t>(tok.vocab_size()); ++id)
    if (const std::string p = tok.piece(id); is_byte_piece(p))
      ids[std::stoul(p.substr(3, 2), nullptr, 16)] = id;
  for (const int32_t id : ids)
    if (id < 0) throw Error("the tokenizer lacks byte-fallback pieces");
  return ids;
}

std::string ids_to_string(std::span<const int32_t> ids) {
  std::string s;
  for (const int32_t id : ids) s += std::to_string(id) + " ";
  return s;
}

// --- the demo tokenizer against Python sentencepiece
// -------------------------------------------------

TEST(TokenizerFixture, MatchesPythonSentencePiece) {
  REQUIRE_DEMO_TOKENIZER();
  if (!fs::exists(kFixture)) GTEST_SKIP() << kFixture.string() << " is missing";
  const json fixture = json::parse(test::read_file(kFixture));
  EXPECT_EQ(fixture.at("tokenizer").get<std::string>(), "models/demo/base/tokenizer.model");
  EXPECT_FALSE(fixture.at("add_bos").get<bool>());
  const auto& cases = fixture.at("cases");
  ASSERT_GE(cases.size(), 200u);

  const Tokenizer& tok = demo_tokenizer();
  size_t round_trips = 0;
  for (const auto& c : cases) {
    const auto text = c.at("text").get<std::string>();
    const auto ids = c.at("ids").get<std::vector<int32_t>>();
    const auto decoded = c.at("decoded").get<std::string>();
    EXPECT_EQ(tok.encode(text, false), ids) << "encoding " << json(text).dump();
    EXPECT_EQ(tok.decode(ids), decoded) << "decoding " << json(text).dump();
    EXPECT_EQ(stream(tok, ids), decoded) << "streaming " << json(text).dump();
    round_trips += decoded == text;
  }
  // The tokenizer uses the identity normalization, so nearly every string comes back unchanged
  // (SentencePiece drops leading spaces and maps some control characters).
  EXPECT_GE(round_trips, cases.size() * 9 / 10);
}

TEST(Tokenizer, DemoSpecialIds) {
  REQUIRE_DEMO_TOKENIZER();
  const Tokenizer& tok = demo_tokenizer();
  const json config = json::parse(test::read_file(kDemoBase / "config.json"));
  EXPECT_EQ(tok.bos_id(), config.at("bos_token_id").get<int32_t>());
  ASSERT_FALSE(tok.eos_ids().empty());
  EXPECT_TRUE(tok.is_eos(tok.eos_ids()[0]));
  EXPECT_FALSE(tok.is_eos(tok.bos_id()));
  EXPECT_TRUE(tok.is_control(tok.bos_id()));
  EXPECT_EQ(tok.piece(tok.bos_id()), "<s>");
  EXPECT_EQ(tok.decode(std::vector<int32_t>{tok.bos_id(), tok.eos_ids()[0]}), "");
}

TEST(Tokenizer, AddBosPrependsBos) {
  REQUIRE_DEMO_TOKENIZER();
  const Tokenizer& tok = demo_tokenizer();
  for (const char* text : {"", "hello world", "  two spaces", "日本語"}) {
    auto expected = tok.encode(text, false);
    expected.insert(expected.begin(), tok.bos_id());
    EXPECT_EQ(tok.encode(text, true), expected) << text;
    EXPECT_EQ(tok.decode(expected), tok.decode(tok.encode(text, false))) << text;
  }
}

TEST(Tokenizer, IdsOutOfRangeAreNamed) {
  REQUIRE_DEMO_TOKENIZER();
  const Tokenizer& tok = demo_tokenizer();
  const auto vocab = static_cast<int32_t>(tok.vocab_size());
  const std::string size = std::to_string(vocab);
  for (const int32_t bad : {vocab, vocab + 1000, -1}) {
    try {
      (void)tok.decode(std::vector<int32_t>{5, bad});
      ADD_FAILURE() << "decode accepted id " << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::to_string(bad)), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(size), std::string::npos) << e.what();
    }
    EXPECT_THROW((void)tok.piece(bad), Error);
    EXPECT_FALSE(tok.valid_id(bad));
  }
  EXPECT_TRUE(tok.valid_id(vocab - 1));
}

TEST(Tokenizer, EncodesAnyBytes) {
  REQUIRE_DEMO_TOKENIZER();
  const Tokenizer& tok = demo_tokenizer();
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    std::string s(rng() % 40, '\0');
    for (auto& ch : s)
      ch = static_cast<char>(rng() % 256);  // mostly malformed UTF-8, NULs included
    std::vector<int32_t> ids;
    ASSERT_NO_THROW(ids = tok.encode(s, trial % 2 == 0));
    for (const int32_t id : ids) ASSERT_TRUE(tok.valid_id(id));
    EXPECT_TRUE(valid_utf8(tok.decode(ids)));
  }
}

// --- files and configuration
// -----------------------------------------------------------------------

// A checkpoint directory holding the demo tokenizer.model and the given JSON files.
void make_dir(const fs::path& dir, const std::map<std::string, std::string>& files) {
  fs::create_directories(dir);
  fs::copy_file(kDemoBase / "tokenizer.model", dir / "tokenizer.model");
  for (const auto& [name, text] : files) write_text(dir / name, text);
}

void expect_error(const fs::path& dir, const std::vector<std::string>& fragments) {
  try {
    Tokenizer tok(dir);
    ADD_FAILURE() << "no error for " << dir;
  } catch (const Error& e) {
    for (const auto& f : fragments)
      EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
  }
}

TEST(Tokenizer, MissingOrCorruptModelIsNamed) {
  TempDir tmp;
  expect_error(tmp.path(),
               {tmp.path().string(), "no tokenizer", "tokenizer.model", "tokenizer.json"});
  write_text(tmp / "tokenizer.model", "this is not a protobuf");
  expect_error(tmp.path(), {(tmp.path() / "tokenizer.model").string(), "SentencePiece"});
}

TEST(Tokenizer, SpecialIdsFromConfigFiles) {
  REQUIRE_DEMO_TOKENIZER();
  TempDir tmp;
  const Tokenizer& demo = demo_tokenizer();

  // No JSON: the SentencePiece model's own ids.
  make_dir(tmp / "none", {});
  const Tokenizer none(tmp / "none");
  EXPECT_EQ(none.bos_id(), demo.bos_id());
  EXPECT_EQ(none.eos_ids(), std::vector<int32_t>{2});

  // config.json alone, eos as a list.
  make_dir(tmp / "config", {{"config.json", R"({"bos_token_id": 5, "eos_token_id": [7, 2, 7]})"}});
  const Tokenizer config(tmp / "config");
  EXPECT_EQ(config.bos_id(), 5);
  EXPECT_EQ(config.eos_ids(), (std::vector<int32_t>{7, 2}));
  EXPECT_TRUE(config.is_eos(7));
  EXPECT_TRUE(config.is_eos(2));
  EXPECT_FALSE(config.is_eos(5));
  EXPECT_EQ(config.encode("a", true).front(), 5);

  // generation_config.json overrides config.json field by field; null means "not set".
  make_dir(tmp / "gen",
           {{"config.json", R"({"bos_token_id": 5, "eos_token_id": 2})"},
            {"generation_config.json", R"({"bos_token_id": null, "eos_token_id": [2, 9]})"}});
  const Tokenizer gen(tmp / "gen");
  EXPECT_EQ(gen.bos_id(), 5);
  EXPECT_EQ(gen.eos_ids(), (std::vector<int32_t>{2, 9}));

  // Bad values name the file and the field.
  const std::string vocab = std::to_string(demo.vocab_size());
  make_dir(tmp / "range", {{"generation_config.json", R"({"eos_token_id": [2, 999999]})"}});
  expect_error(tmp / "range", {"generation_config.json", "eos_token_id", "999999", vocab});
  make_dir(tmp / "bos", {{"config.json", R"({"bos_token_id": 999999})"}});
  expect_error(tmp / "bos", {"config.json", "bos_token_id", "999999"});
  make_dir(tmp / "type", {{"config.json", R"({"eos_token_id": "</s>"})"}});
  expect_error(tmp / "type", {"config.json", "eos_token_id", "</s>"});
  make_dir(tmp / "negative", {{"config.json", R"({"bos_token_id": -1})"}});
  expect_error(tmp / "negative", {"config.json", "bos_token_id"});
  make_dir(tmp / "json", {{"generation_config.json", "{not json"}});
  expect_error(tmp / "json", {"generation_config.json", "invalid JSON"});

  // tokenizer_config.json's add_bos_token decides whether BOS goes first, as in transformers.
  EXPECT_TRUE(none.adds_bos());  // SentencePiece with a BOS
  make_dir(tmp / "nobos", {{"tokenizer_config.json", R"({"add_bos_token": false})"}});
  const Tokenizer nobos(tmp / "nobos");
  EXPECT_FALSE(nobos.adds_bos());
  EXPECT_EQ(nobos.bos_id(), demo.bos_id());  // still known, for templates that ask for it
  make_dir(tmp / "badbos", {{"tokenizer_config.json", R"({"add_bos_token": "yes"})"}});
  expect_error(tmp / "badbos", {"tokenizer_config.json", "add_bos_token", "\"yes\""});
}

// --- streaming
// ---------------------------------------------------------------------------------------

TEST(StreamDecoder, MultibyteTextStreamsWholeCharacters) {
  REQUIRE_DEMO_TOKENIZER();
  const Tokenizer& tok = demo_tokenizer();
  const std::vector<std::string> texts = {
      "café naïve résumé Ångström œuvre",
      "東京 日本語のテキスト 中文 你好，世界！",
      "한국어 Привет Ελληνικά",
      "emoji 🎉 party 🙂👍🏽 👨‍👩‍👧 🇫🇷",
      "a🙂b",
      "€100 ½ ™ ©",
      "  two leading spaces",
      "\n\nnewlines first",
      "<|user|>\nhi\n<|assistant|>\n",
      "mixed 東京🙂café\tend   "};
  for (const auto& text : texts) {
    const auto ids = tok.encode(text, true);
    EXPECT_EQ(stream(tok, ids), tok.decode(ids)) << text;
    EXPECT_EQ(stream(tok, std::span(ids).subspan(1)), tok.decode(std::span(ids).subspan(1)))
        << text;
  }
  // An emoji the tokenizer spells as byte pieces comes out only when its last byte arrives.
  const auto ids = tok.encode("🙂", false);
  StreamDecoder decoder(tok);
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    const std::string piece = decoder.push(ids[i]);
    if (i + 1 < ids.size() && is_byte_piece(tok.piece(ids[i]))) {
      EXPECT_EQ(piece, "") << i;
    }
    text += piece;
  }
  EXPECT_EQ(text + decoder.finish(), tok.decode(ids));
}

TEST(StreamDecoder, LeadingSpaceFollowsDecode) {
  REQUIRE_DEMO_TOKENIZER();
  const Tokenizer& tok = demo_tokenizer();
  StreamDecoder decoder(tok);
  std::string text;
  for (const int32_t id : tok.encode("hello world", true)) text += decoder.push(id);
  EXPECT_EQ(text + decoder.finish(), "hello world");
  // finish() resets: the next sequence again drops its leading space.
  for (const int32_t id : tok.encode("again", false)) text += decoder.push(id);
  EXPECT_EQ(text + decoder.finish(), "hello worldagain");
}

TEST(StreamDecoder, UnfinishedCharacterFlushesAsDecodeDoes) {
  REQUIRE_DEMO_TOKENIZER();
  const Tokenizer& tok = demo_tokenizer();
  const auto bytes = byte_ids(tok);
  // "hi" then the first two of the three bytes of "€" (E2 82 AC).
  std::vector<int32_t> ids = tok.encode("hi", false);
  ids.push_back(bytes[0xE2]);
  ids.push_back(bytes[0x82]);
  StreamDecoder decoder(tok);
  std::string text;
  for (const int32_t id : ids) text += decoder.push(id);
  EXPECT_EQ(text, "hi");  // the bytes wait for the rest of the character
  text += decoder.finish();
  EXPECT_EQ(text, tok.decode(ids));
  EXPECT_EQ(text, "hi\uFFFD\uFFFD");  // as decode: one replacement character per stray byte
}

TEST(StreamDecoder, RejectsIdOutOfRangeAndKeepsGoing) {
  REQUIRE_DEMO_TOKENIZER();
  const Tokenizer& tok = demo_tokenizer();
  const auto ids = tok.encode("hello there", false);
  StreamDecoder decoder(tok);
  std::string text = decoder.push(ids[0]);
  EXPECT_THROW((void)decoder.push(static_cast<int32_t>(tok.vocab_size())), Error);
  for (size_t i = 1; i < ids.size(); ++i) text += decoder.push(ids[i]);
  EXPECT_EQ(text + decoder.finish(), "hello there");
}

// Random id sequences over the whole vocabulary, weighted towards the hard cases: byte pieces
// (valid and broken characters), control and unknown tokens, pieces of spaces only.
TEST(StreamDecoder, RandomSequencesEqualDecode) {
  REQUIRE_DEMO_TOKENIZER();
  const Tokenizer& tok = demo_tokenizer();
  const std::vector<int32_t> byte_id = byte_ids(tok);
  std::vector<int32_t> special, spaces;
  for (int32_t id = 0; id < static_cast<int32_t>(tok.vocab_size()); ++id) {
    const std::string p = tok.piece(id);
    if (is_byte_piece(p)) continue;
    if (tok.is_control(id) || p == "<unk>") {
      special.push_back(id);
    } else if (p.find_first_not_of("\xE2\x96\x81") == std::string::npos) {
      spaces.push_back(id);  // "▁", "▁▁", ...
    }
  }
  ASSERT_FALSE(special.empty());
  ASSERT_FALSE(spaces.empty());

  std::mt19937_64 rng(2024);
  const auto pick = [&](const std::vector<int32_t>& v) { return v[rng() % v.size()]; };
  // A whole character as byte pieces, sometimes cut short or with a stray continuation byte.
  const auto push_char = [&](std::vector<int32_t>& ids) {
    static const std::vector<std::string> chars = {"é", "€", "日", "🙂", "ß", "\xF0\x9F\x87\xAB"};
    std::string c = chars[rng() % chars.size()];
    if (rng() % 4 == 0) c.pop_back();
    if (rng() % 8 == 0) c += '\x80';
    for (const char ch : c) ids.push_back(byte_id[static_cast<uint8_t>(ch)]);
  };
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<int32_t> ids;
    const size_t len = 1 + rng() % 30;
    while (ids.size() < len) {
      switch (rng() % 6) {
        case 0:
          push_char(ids);
          break;
        case 1:
          ids.push_back(byte_id[rng() % 256]);
          break;
        case 2:
          ids.push_back(pick(special));
          break;
        case 3:
          ids.push_back(pick(spaces));
          break;
        default:
          ids.push_back(static_cast<int32_t>(rng() % tok.vocab_size()));
          break;
      }
    }
    ASSERT_EQ(stream(tok, ids), tok.decode(ids)) << "ids: " << ids_to_string(ids);
  }
}

TEST(StreamDecoder, LongGenerationStaysExact) {
  REQUIRE_DEMO_TOKENIZER();
  const Tokenizer& tok = demo_tokenizer();
  std::mt19937_64 rng(99);
  std::vector<int32_t> ids(5000);
  for (auto& id : ids) id = static_cast<int32_t>(rng() % tok.vocab_size());
  EXPECT_EQ(stream(tok, ids), tok.decode(ids));
}

// ---------------------------------------------------------------------------------------------
// Byte-level BPE from tokenizer.json: three pre-tokenizer configurations of released checkpoints
// (Llama 3, Qwen2, GPT-2) against the ids a reference written from the format's definition gives
// (tests/fixtures/bpe, by tools/bpe_fixture/make_fixture.py).

const fs::path kBpeFixtures = kSourceDir / "tests/fixtures/bpe";

json bpe_cases() {
  std::ifstream in(kBpeFixtures / "cases.json");
  return json::parse(in);
}

std::string unhex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2)
    out += char(std::stoi(hex.substr(i, 2), nullptr, 16));
  return out;
}

json bpe_json(const std::string& variant) {
  std::ifstream in(kBpeFixtures / ("tokenizer_" + variant + ".json"));
  return json::parse(in);
}

// A checkpoint directory with only this tokenizer.json.
void write_bpe(const fs::path& dir, const json& tokenizer) {
  write_text(dir / "tokenizer.json", tokenizer.dump());
}

TEST(ByteLevelBpe, MatchesTheReferenceForThreeConfigurations) {
  const json cases = bpe_cases();
  ASSERT_EQ(cases["variants"].size(), 3u);
  for (const auto& [variant, entry] : cases["variants"].items()) {
    SCOPED_TRACE(variant);
    TempDir tmp;
    write_bpe(tmp.path(), bpe_json(variant));
    const Tokenizer tok(tmp.path());
    const auto bos = entry["bos"].get<std::vector<int32_t>>();
    EXPECT_EQ(tok.adds_bos(), !bos.empty());
    if (!bos.empty()) {
      EXPECT_EQ(tok.bos_id(), bos[0]);
    }
    ASSERT_GE(entry["cases"].size(), 40u);
    for (const auto& c : entry["cases"]) {
      const std::string text = unhex(c["hex"]);
      const auto ids = c["ids"].get<std::vector<int32_t>>();
      EXPECT_EQ(tok.encode(text, tok.adds_bos()), ids) << "text: " << text;
      EXPECT_EQ(tok.decode(ids), c["decoded"].get<std::string>()) << "text: " << text;
      EXPECT_EQ(stream(tok, ids), c["decoded"].get<std::string>()) << "text: " << text;
    }
  }
}

TEST(ByteLevelBpe, TokensReadAsTheirBytesAndSpecialsAsControl) {
  TempDir tmp;
  write_bpe(tmp.path(), bpe_json("llama3"));
  const Tokenizer tok(tmp.path());
  const json vocab = bpe_json("llama3")["model"]["vocab"];
  // "Ġ" spells the space byte, "Ċ" the newline: GPT-2's alphabet.
  const int32_t space = vocab["\xC4\xA0"], newline = vocab["\xC4\x8A"];
  EXPECT_EQ(tok.token_text(space), " ");
  EXPECT_EQ(tok.piece(space), "\xC4\xA0");
  EXPECT_EQ(tok.token_text(newline), "\n");
  EXPECT_EQ(tok.decode(std::vector<int32_t>{space, newline}), " \n");
  const int32_t eot = 960;  // <|eot_id|>: the fifth added token after 956 in the vocabulary
  EXPECT_TRUE(tok.is_control(eot));
  EXPECT_EQ(tok.token_text(eot), "<|eot_id|>");
  EXPECT_EQ(tok.decode(std::vector<int32_t>{space, eot, newline}), " \n");
  // The vocabulary size counts up to the last added token (<tool>, 961).
  EXPECT_EQ(tok.vocab_size(), 962u);
  EXPECT_THROW(tok.decode(std::vector<int32_t>{962}), Error);
  // Special ids from config.json override the template's BOS; EOS comes only from there.
  EXPECT_TRUE(tok.eos_ids().empty());
  write_text(tmp / "tokenizer_config.json", R"({"add_bos_token": false})");
  EXPECT_FALSE(Tokenizer(tmp.path()).adds_bos());
  fs::remove(tmp / "tokenizer_config.json");
  // Qwen2's configuration has no BOS: asking for one is an error naming the file.
  TempDir qwen;
  write_bpe(qwen.path(), bpe_json("qwen2"));
  EXPECT_FALSE(Tokenizer(qwen.path()).adds_bos());
  write_text(qwen / "tokenizer_config.json", R"({"add_bos_token": true})");
  expect_error(qwen.path(), {"tokenizer_config.json", "add_bos_token is true", "no BOS id"});
  write_text(tmp / "config.json", R"({"bos_token_id": 959, "eos_token_id": [960, 959]})");
  const Tokenizer configured(tmp.path());
  EXPECT_EQ(configured.bos_id(), 959);
  EXPECT_EQ(configured.eos_ids(), (std::vector<int32_t>{960, 959}));
}

// Added tokens get the ids the tokenizers library gives them on reading the file, not the file's
// where the two differ (AddedVocabulary::add_tokens; the session-45 device check found tokenizers
// giving 956 to a token the file put at 958): a content model.vocab holds keeps its vocabulary id,
// any other takes the vocabulary's size or the largest added id + 1, and a repeat is skipped.
TEST(ByteLevelBpe, AddedTokensTakeTheIdsTheTokenizersLibraryGives) {
  json tk = bpe_json("llama3");
  const json vocab = tk["model"]["vocab"];
  ASSERT_EQ(vocab.size(), 956u);
  json& added = tk["added_tokens"];
  for (size_t i = 0; i < added.size(); ++i)
    added[i]["id"] = 2000 + 3 * int(i);  // the file's ids, not kept
  json again = added[4];                 // <|eot_id|> once more, at another id: skipped
  again["id"] = 7;
  added.push_back(again);
  json known = added[5];  // a content the vocabulary has ("the"), listed at another id
  known["content"] = "the";
  known["id"] = 3000;
  known["lstrip"] = known["rstrip"] = false;
  added.push_back(known);
  json last = known;  // after an id inside the vocabulary, the next new one is past the largest
  last["content"] = "<last>";
  added.push_back(last);
  TempDir tmp;
  write_bpe(tmp.path(), tk);
  const Tokenizer tok(tmp.path());
  EXPECT_EQ(tok.encode("<|begin_of_text|>", false), std::vector<int32_t>{956});
  EXPECT_EQ(tok.encode("<|eot_id|>", false), std::vector<int32_t>{960});
  EXPECT_EQ(tok.encode("x<tool>", false), (std::vector<int32_t>{vocab["x"].get<int32_t>(), 961}));
  EXPECT_EQ(tok.encode(" the", false).back(), vocab["the"].get<int32_t>());
  EXPECT_EQ(tok.encode("<last>", false), std::vector<int32_t>{962});
  EXPECT_EQ(tok.token_text(960), "<|eot_id|>");
  EXPECT_EQ(tok.vocab_size(), 963u);
  // The template's BOS is the id the template names (956 here, as the fixture writes it).
  EXPECT_EQ(tok.encode("hi", true).front(), 956);
}

// ignore_merges (Llama 3): a word the vocabulary holds whole is that token, even where the merges
// would spell it otherwise.
TEST(ByteLevelBpe, IgnoreMergesTakesWholeWordsFromTheVocabulary) {
  json tk = bpe_json("llama3");
  tk["model"]["vocab"]["qqqz"] = 5000;  // no merge makes it
  // One more vocabulary entry moves the added tokens one id on (tokenizers gives them ids from the
  // vocabulary's size), the template's BOS with them.
  tk["post_processor"]["processors"][1]["special_tokens"]["<|begin_of_text|>"]["ids"] = {957};
  TempDir with, without;
  write_bpe(with.path(), tk);
  tk["model"]["ignore_merges"] = false;
  write_bpe(without.path(), tk);
  const Tokenizer a(with.path()), b(without.path());
  EXPECT_EQ(a.encode("qqqz", false), std::vector<int32_t>{5000});
  const auto merged = b.encode("qqqz", false);
  EXPECT_GT(merged.size(), 1u);
  EXPECT_EQ(b.decode(merged), "qqqz");
}

TEST(ByteLevelBpe, EncodesFromManyThreadsAtOnce) {
  TempDir tmp;
  write_bpe(tmp.path(), bpe_json("qwen2"));
  const Tokenizer tok(tmp.path());
  const json cases = bpe_cases()["variants"]["qwen2"]["cases"];
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int round = 0; round < 20; ++round)
        for (const auto& c : cases)
          if (tok.encode(unhex(c["hex"]), false) != c["ids"].get<std::vector<int32_t>>()) ++wrong;
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong, 0);
}

TEST(ByteLevelBpe, UnsupportedOrBrokenFilesAreNamed) {
  const json good = bpe_json("llama3");
  const auto expect_bpe_error = [&](const std::function<void(json&)>& edit,
                                    const std::vector<std::string>& fragments) {
    json tk = good;
    edit(tk);
    TempDir tmp;
    write_bpe(tmp.path(), tk);
    std::vector<std::string> all = {(tmp.path() / "tokenizer.json").string()};
    all.insert(all.end(), fragments.begin(), fragments.end());
    expect_error(tmp.path(), all);
  };
  expect_bpe_error([](json& t) { t["model"]["type"] = "WordPiece"; },
                   {"model.type \"WordPiece\" is not supported"});
  expect_bpe_error([](json& t) { t["model"]["byte_fallback"] = true; },
                   {"byte_fallback", "tokenizer.model"});
  expect_bpe_error([](json& t) { t["model"]["merges"][3] = "nosuch token"; },
                   {"model.merges[3]", "not in model.vocab"});
  expect_bpe_error([](json& t) { t["model"]["merges"][4] = "a"; }, {"model.merges[4]"});
  expect_bpe_error([](json& t) { t["model"]["vocab"].erase("!"); }, {"no token for byte 33"});
  expect_bpe_error([](json& t) { t["model"]["vocab"]["dup"] = 7; }, {"id 7 to two tokens"});
  expect_bpe_error(
      [](json& t) {
        t["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "_"}};
      },
      {"pre_tokenizer type 'Metaspace' is not supported"});
  expect_bpe_error([](json& t) { t["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"; },
                   {"pre_tokenizer.pretokenizers[0].behavior 'Removed' is not supported"});
  expect_bpe_error(
      [](json& t) { t["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(a"; },
      {"pre_tokenizer.pretokenizers[0] pattern does not compile"});
  expect_bpe_error([](json& t) { t["pre_tokenizer"] = t["pre_tokenizer"]["pretokenizers"][0]; },
                   {"no ByteLevel step"});
  expect_bpe_error(
      [](json& t) {
        t["normalizer"] = {{"type", "Lowercase"}};
      },
      {"normalizer type 'Lowercase' is not supported"});
  expect_bpe_error(
      [](json& t) {
        t["decoder"] = {{"type", "Metaspace"}};
      },
      {"decoder type 'Metaspace' is not supported"});
  expect_bpe_error(
      [](json& t) {
        auto& single = t["post_processor"]["processors"][1]["single"];
        single.push_back(single[0]);
      },
      {"after the text"});
  expect_bpe_error([](json& t) { t["added_tokens"][0]["id"] = "40"; },
                   {"added_tokens[0].id must be a token id"});
  expect_bpe_error([](json& t) { t["added_tokens"][1]["content"] = ""; },
                   {"added_tokens[1] must be an object with a non-empty content"});
  TempDir tmp;
  write_text(tmp / "tokenizer.json", "{\"model\": ");
  expect_error(tmp.path(), {(tmp.path() / "tokenizer.json").string()});
}

}  // namespace
}  // namespace bitdelta
