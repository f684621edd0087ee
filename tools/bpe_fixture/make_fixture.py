#!/usr/bin/env python3
"""Fixtures for the C++ byte-level BPE tokenizer (src/tokenizer/bpe.cpp): a `tokenizer.json` in the
Hugging Face `tokenizers` format, trained here on a small corpus, and test strings with their ids as
a plain reference computes them, for three configurations of the pre-tokenizer found in released
checkpoints (Llama 3, Qwen2, GPT-2).

    python3 tools/bpe_fixture/make_fixture.py tests/fixtures/bpe          # writes; needs `regex`
    python3 tools/bpe_fixture/make_fixture.py tests/fixtures/bpe --check  # against HF tokenizers

The reference is written from the format's definition, in Python with the `regex` module (not the
regex engine the C++ code uses): added tokens are split out first (leftmost, longest; lstrip/rstrip
take the whitespace beside them), each other piece is pre-tokenized (Split: the pattern's matches
and the text between them; ByteLevel: optional prefix space, optional GPT-2 pattern), mapped byte
by byte to the GPT-2 alphabet and merged pair by pair, lowest rank first, leftmost first. Special tokens of
the post-processor's template go in front. Decoding joins the bytes of non-special tokens and reads
them as UTF-8 with U+FFFD for each maximal invalid subpart.
"""
import argparse
import collections
import json
import os
import sys
import unicodedata

import regex

LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# Unicode White_Space, the whitespace lstrip/rstrip take (Rust's char::is_whitespace).
WHITE_SPACE = set("\t\n\v\f\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000") | {
    chr(c) for c in range(0x2000, 0x200B)}


def byte_alphabet():
    """GPT-2's map of the 256 bytes to printable characters."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) +
                 list(range(ord("®"), ord("ÿ") + 1)))
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


BYTE_CHAR = byte_alphabet()
CHAR_BYTE = {c: b for b, c in BYTE_CHAR.items()}

WORDS = ("the quick brown fox jumps over lazy dog and then returns to its den while the wind "
         "shall blow over seas def return import class self value number sum of license agreement "
         "party hereby I'm you're they'll we've she'd it's don't café naïve résumé über straße "
         "日本語 の テキスト です 中文 文本 模型 κείμενο δέλτα текст модель 🙂 👍").split()


def corpus():
    import random
    rng = random.Random(7)
    lines = []
    for _ in range(1500):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 14))]
        line = " ".join(words)
        if rng.random() < 0.3:
            line += f" {rng.randint(0, 99999)}"
        if rng.random() < 0.2:
            line = "    " + line.replace(" ", "_", 1) + "(x):"
        lines.append(line)
    return "\n".join(lines) + "\n"


def split_isolated(pattern, text):
    out, last = [], 0
    for m in pattern.finditer(text):
        if m.start() > last:
            out.append(text[last:m.start()])
        out.append(m.group())
        last = m.end()
    if last < len(text):
        out.append(text[last:])
    return [p for p in out if p]


def train(text, merges_wanted):
    """Byte-level BPE merges, most frequent pair first (ties: the larger pair as strings)."""
    pattern = regex.compile(LLAMA3)
    counts = collections.Counter()
    for word in split_isolated(pattern, text):
        counts[tuple(BYTE_CHAR[b] for b in word.encode())] += 1
    # The 256 byte tokens in the order of their characters, as GPT-2's vocabulary has them (so an
    # id is not its byte).
    vocab = sorted(BYTE_CHAR.values())
    merges = []
    words = dict(counts)
    for _ in range(merges_wanted):
        pairs = collections.Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        vocab.append(best[0] + best[1])
        merged = {}
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + c
        words = merged
    return vocab, merges


SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>"]


def tokenizer_json(vocab, merges, variant):
    n = len(vocab)
    added = []
    # The added tokens' ids follow the vocabulary's, as in released files (and as the tokenizers
    # library gives them whatever the file says: Reference.added_ids).
    for i, content in enumerate(SPECIALS):
        added.append({"id": n + i, "content": content, "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": True})
    added.append({"id": n + len(SPECIALS), "content": "<tool>", "single_word": False,
                  "lstrip": True, "rstrip": True, "normalized": False, "special": False})
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": False}
    tk = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
          "normalizer": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True,
                                          "trim_offsets": True, "use_regex": True}}
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
             "ignore_merges": False, "vocab": {t: i for i, t in enumerate(vocab)}}
    if variant == "llama3":
        tk["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3}, "behavior": "Isolated",
             "invert": False}, byte_level]}
        bos = SPECIALS[0]
        tk["post_processor"] = {"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
             "use_regex": True},
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                        {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                      {"Sequence": {"id": "A", "type_id": 0}},
                      {"SpecialToken": {"id": bos, "type_id": 1}},
                      {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {bos: {"id": bos, "ids": [n], "tokens": [bos]}}}]}
        model["ignore_merges"] = True
        model["merges"] = [f"{a} {b}" for a, b in merges]
    elif variant == "qwen2":
        tk["normalizer"] = {"type": "NFC"}
        tk["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2}, "behavior": "Isolated",
             "invert": False}, byte_level]}
        tk["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False,
                                "trim_offsets": False, "use_regex": False}
        model["merges"] = [[a, b] for a, b in merges]  # the newer format: pairs
    elif variant == "gpt2":
        tk["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": True,
                               "trim_offsets": True, "use_regex": True}
        tk["post_processor"] = {"type": "ByteLevel", "add_prefix_space": True,
                                "trim_offsets": False, "use_regex": True}
        model["merges"] = [f"{a} {b}" for a, b in merges]
    else:
        raise ValueError(variant)
    tk["model"] = model
    return tk


class Reference:
    """Encodes and decodes as the tokenizer.json says, written from the format's definition."""

    def __init__(self, tk):
        self.tk = tk
        model = tk["model"]
        self.vocab = model["vocab"]
        self.ranks = {}
        for r, m in enumerate(model["merges"]):
            a, b = m.split(" ") if isinstance(m, str) else m
            self.ranks[(a, b)] = r
        self.ignore_merges = model.get("ignore_merges", False)
        self.added = self.added_ids(tk["added_tokens"])
        self.by_id = {i: t for t, i in self.vocab.items()}
        self.special_ids = {t["id"] for t in self.added if t["special"]}
        for t in self.added:
            self.by_id[t["id"]] = t["content"]
        pre = tk["pre_tokenizer"]
        self.steps = pre["pretokenizers"] if pre["type"] == "Sequence" else [pre]
        self.bos = []
        post = tk["post_processor"]
        for p in (post["processors"] if post and post["type"] == "Sequence" else [post]):
            if p and p["type"] == "TemplateProcessing":
                for item in p["single"]:
                    if "Sequence" in item:
                        break
                    self.bos += p["special_tokens"][item["SpecialToken"]["id"]]["ids"]

    def added_ids(self, added):
        """The added tokens with the ids the tokenizers library gives them on reading the file
        (AddedVocabulary::add_tokens): a token in the vocabulary keeps its id; any other gets the
        vocabulary's size, or the largest added id + 1 once that is past it; a repeat is skipped."""
        out, n, largest = [], len(self.vocab), -1
        for t in added:
            if any(o["content"] == t["content"] for o in out):
                continue
            i = self.vocab[t["content"]] if t["content"] in self.vocab else max(largest + 1, n)
            largest = max(largest, i)
            out.append(dict(t, id=i))
        return out

    def split_added(self, text):
        pieces, start, i = [], 0, 0
        while i < len(text):
            best = None
            for t in self.added:
                if text.startswith(t["content"], i) and (
                        best is None or len(t["content"]) > len(best["content"])):
                    best = t
            if best is None:
                i += 1
                continue
            s, e = i, i + len(best["content"])
            if best["lstrip"]:
                while s > start and text[s - 1] in WHITE_SPACE:
                    s -= 1
            if best["rstrip"]:
                while e < len(text) and text[e] in WHITE_SPACE:
                    e += 1
            pieces.append(text[start:s])
            pieces.append(best["id"])
            start = i = e
        pieces.append(text[start:])
        return [p for p in pieces if p != ""]

    def pre_tokenize(self, text):
        if self.tk["normalizer"] and self.tk["normalizer"]["type"] == "NFC":
            text = unicodedata.normalize("NFC", text)
        pieces = [text]
        for st in self.steps:
            out = []
            for p in pieces:
                if st["type"] == "Split":
                    out += split_isolated(regex.compile(st["pattern"]["Regex"]), p)
                elif st["type"] == "ByteLevel":
                    if st.get("add_prefix_space") and not p.startswith(" "):
                        p = " " + p
                    out += split_isolated(regex.compile(GPT2), p) if st.get("use_regex", True) \
                        else [p]
                else:
                    raise ValueError(st["type"])
            pieces = out
        return pieces

    def bpe(self, word):
        if self.ignore_merges and word in self.vocab:
            return [self.vocab[word]]
        syms = list(word)
        while True:
            best = None
            for i in range(len(syms) - 1):
                r = self.ranks.get((syms[i], syms[i + 1]))
                if r is not None and (best is None or r < best[0]):
                    best = (r, i)
            if best is None:
                break
            i = best[1]
            syms[i:i + 2] = [syms[i] + syms[i + 1]]
        return [self.vocab[s] for s in syms]

    def encode(self, data):
        text = data.decode("utf-8", "replace")
        ids = list(self.bos)
        for piece in self.split_added(text):
            if isinstance(piece, int):
                ids.append(piece)
                continue
            for word in self.pre_tokenize(piece):
                ids += self.bpe("".join(BYTE_CHAR[b] for b in word.encode()))
        return ids

    def decode(self, ids):
        out = b""
        for i in ids:
            if i in self.special_ids:
                continue
            token = self.by_id[i]
            if any(t["id"] == i for t in self.added):
                out += token.encode()
            else:
                out += bytes(CHAR_BYTE[c] for c in token)
        return out.decode("utf-8", "replace")


def test_strings(text):
    s = ["", "hello", "Hello world", " leading space", "trailing space ", "two  spaces",
         "tabs\tand\nnewlines\n\n", "   \n  \n", "I'm sure they'll've", "DON'T SHOUT, IT'S LOUD",
         "numbers 1 12 123 1234 12345", "3.14159 and 2,000,000", "x = f(y) + 12*z; // comment",
         "def foo(bar):\n    return bar**2\n", "café naïve résumé", "日本語のテキスト",
         "中文 mixed with English", "emoji 🙂👍🏽 here", "Ünïcödé straße", "αβγ δέλτα κείμενο",
         "кириллица текст", "<|begin_of_text|>already", "a<|eot_id|>b",
         "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>", "x <tool> y", "<tool>",
         "  <tool>\n z", "aaaaaaaaaaaaaaaaaaaa", "the the the the", "!!!???...", "\u00a0nbsp",
         "line\r\nwindows", "<|eot_id", "tool>", "zzz qqq xxx", "the quickbrownfox",
         text[:400], text[1000:1300],
         # A Llama 3 chat prompt as bitdelta renders [{"role": "user", "content": "hi"}].
         "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
         "<|start_header_id|>assistant<|end_header_id|>\n\n"]
    return [t.encode() for t in s] + [b"bad \xff byte", b"cut \xe6\x97", b"\xe0\x80\x80 overlong",
                                      b"\xf0\x9f\x99 split emoji", b"\xc3"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--check", action="store_true",
                    help="compare the written cases with the tokenizers package")
    args = ap.parse_args()
    if args.check:
        from tokenizers import Tokenizer
        cases = json.load(open(os.path.join(args.out, "cases.json")))
        bad = 0
        for variant, entry in cases["variants"].items():
            tk = Tokenizer.from_file(os.path.join(args.out, f"tokenizer_{variant}.json"))
            for c in entry["cases"]:
                data = bytes.fromhex(c["hex"])
                got = tk.encode(data.decode("utf-8", "replace")).ids
                text = tk.decode(c["ids"], skip_special_tokens=True)
                if got != c["ids"] or text != c["decoded"]:
                    bad += 1
                    print(f"{variant} {data!r}: ids {got} vs {c['ids']}, "
                          f"decoded {text!r} vs {c['decoded']!r}")
        total = sum(len(e["cases"]) for e in cases["variants"].values())
        print(f"{total - bad}/{total} cases agree with tokenizers")
        sys.exit(1 if bad else 0)

    os.makedirs(args.out, exist_ok=True)
    text = corpus()
    vocab, merges = train(text, 700)
    out = {"about": "written by tools/bpe_fixture/make_fixture.py; text as hex bytes", "variants": {}}
    for variant in ("llama3", "qwen2", "gpt2"):
        tk = tokenizer_json(vocab, merges, variant)
        with open(os.path.join(args.out, f"tokenizer_{variant}.json"), "w") as f:
            json.dump(tk, f, ensure_ascii=False, indent=None, separators=(",", ":"))
        ref = Reference(tk)
        cases = []
        for data in test_strings(text):
            ids = ref.encode(data)
            cases.append({"hex": data.hex(), "ids": ids, "decoded": ref.decode(ids)})
        out["variants"][variant] = {"bos": ref.bos, "cases": cases}
    with open(os.path.join(args.out, "cases.json"), "w") as f:
        json.dump(out, f, ensure_ascii=False, indent=None, separators=(",", ":"))
    print(f"vocabulary {len(vocab)}, merges {len(merges)}; "
          f"{sum(len(v['cases']) for v in out['variants'].values())} cases")


if __name__ == "__main__":
    main()
