#!/usr/bin/env python3
"""Re-check the committed reference fixtures against the committed demo weights, on the CPU.

    python3 tools/demo_family/verify_fixtures.py          # needs torch and sentencepiece (Debian:
                                                          # python3-torch, python3-sentencepiece)

Independent of transformers and of the GPU that made the fixtures: the forward is train.py's
reference_logits, the tokenizer is whatever sentencepiece is installed here (Debian's is the same
version as the C++ library the engine links). Exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import sentencepiece as spm
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train as T  # noqa: E402

TOLERANCE = 1e-4  # float32 logits and log-probs, GPU (fixtures) vs CPU (here)


def main() -> int:
    repo = Path(__file__).resolve().parents[2]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=repo, help="folder holding models/demo and tests/fixtures")
    args = ap.parse_args()
    demo, fx = args.root / "models/demo", args.root / "tests/fixtures/reference"
    failures = 0

    sp = spm.SentencePieceProcessor(model_file=str(demo / "base/tokenizer.model"))
    cases = json.loads((fx / "tokenizer_cases.json").read_text())["cases"]
    bad = [c["text"] for c in cases if sp.encode(c["text"]) != c["ids"] or sp.decode(c["ids"]) != c["decoded"]]
    print(f"tokenizer: sentencepiece {spm.__version__}, {len(cases)} cases, {len(bad)} mismatches {bad[:3]}")
    failures += len(bad)
    prompts = json.loads((fx / "prompts.json").read_text())["prompts"]
    for p in prompts:
        if p["kind"] == "text" and [T.BOS_ID] + sp.encode(p["text"]) != p["ids"]:
            print(f"prompt {p['name']}: ids differ")
            failures += 1

    states = {m: T.load_checkpoint_f32(demo / m) for m in ["base", *T.VARIANTS]}
    worst_lp = worst_top = 0.0
    for v in ["base", *T.VARIANTS]:
        for mode in ([""] if v == "base" else ["", "row", "tensor"]):
            name = v + (f".bitdelta_{mode}" if mode else "")
            sd = T.bitdelta_state(states["base"], states[v], mode) if mode else states[v]
            fix = json.loads((fx / f"model_{name.replace('.', '_')}.json").read_text())
            for p, r in zip(prompts, fix["results"], strict=True):
                ids = list(p["ids"])
                with torch.no_grad():
                    logits = T.reference_logits(sd, T.ARCH, torch.tensor([ids]))[0]
                lp = torch.log_softmax(logits, -1)
                mine = [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]
                worst_lp = max([worst_lp] + [abs(a - b) for a, b in zip(mine, r["prompt_logprobs"], strict=True)])
                top = logits[-1][r["top20"]["ids"]]
                worst_top = max(worst_top, (top - torch.tensor(r["top20"]["logits"])).abs().max().item())
                for k, (want, margin) in enumerate(zip(r["greedy"]["ids"], r["greedy"]["margins"])):
                    if k:
                        with torch.no_grad():
                            logits = T.reference_logits(sd, T.ARCH, torch.tensor([ids]))[0]
                    got = int(logits[-1].argmax())
                    if got != want:
                        if margin > 1e-3:
                            print(f"{name} {p['name']}: greedy step {k} gives {got}, fixture {want}")
                            failures += 1
                        break
                    ids.append(got)
    print(f"models: max |log-prob diff| {worst_lp:.2e}, max |top-20 logit diff| {worst_top:.2e}")
    failures += (worst_lp > TOLERANCE) + (worst_top > TOLERANCE)

    deltas = json.loads((fx / "deltas.json").read_text())["variants"]
    n = 0
    for v, entry in deltas.items():
        for name, rec in entry.items():
            sign, alpha_row = T.bitdelta_parts(states["base"][name], states[v][name], "row")
            _, alpha_tensor = T.bitdelta_parts(states["base"][name], states[v][name], "tensor")
            ok = (hashlib.sha256(T.pack_sign_bits(sign)).hexdigest() == rec["sign_bytes_sha256"]
                  and T.f32(alpha_tensor.item()) == rec["alpha_tensor"]
                  and [T.f32(a) for a in alpha_row.flatten()[:8]] == rec["alpha_row_first8"])
            failures += not ok
            n += 1
    print(f"deltas: {n} weights checked")
    print("OK" if failures == 0 else f"FAILED: {failures} problems")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
