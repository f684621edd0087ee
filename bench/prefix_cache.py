#!/usr/bin/env python3
"""A conversation sent turn by turn (each prompt is the one before, its answer and a new message),
against servers side by side: one that keeps finished sequences' caches (the default) and one that
does not (--prefix-cache-bytes 0). Prints per server and turn the prompt tokens, those taken from a
kept cache (/metrics) and the time to the answer, then medians over repetitions and their ratio.

    build/bitdelta serve --port 18555 &
    build/bitdelta serve --port 18556 --prefix-cache-bytes 0 &
    python3 bench/prefix_cache.py --urls http://127.0.0.1:18555,http://127.0.0.1:18556
"""
import argparse
import json
import random
import statistics
import time
import urllib.request


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--urls", required=True, help="comma-separated servers, run alternately")
    ap.add_argument("--model", default="writer")
    ap.add_argument("--first", type=int, default=300, help="tokens of the first prompt")
    ap.add_argument("--message", type=int, default=40, help="tokens each later turn adds")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--answer", type=int, default=8, help="tokens of each answer")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    urls = a.urls.split(",")

    def post(url, body):
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req).read())

    def cached(url):
        for line in urllib.request.urlopen(url + "/metrics").read().decode().splitlines():
            if line.startswith("bitdelta_prompt_tokens_cached_total "):
                return float(line.split()[1])
        raise SystemExit("bitdelta_prompt_tokens_cached_total is not in /metrics")

    def tokens(n, seed):  # n token ids drawn from 5..3004, the same for the same seed
        rng = random.Random(seed)
        return [rng.randrange(5, 3005) for _ in range(n)]

    totals = {u: [] for u in urls}
    for rep in range(a.reps):
        for url in urls:
            prompt = [1] + tokens(a.first, 1000 * rep + 1)
            total = 0.0
            for turn in range(a.turns):
                before = cached(url)
                t = time.perf_counter()
                out = post(url, {"model": a.model, "prompt": prompt, "max_tokens": a.answer,
                                 "temperature": 0, "ignore_eos": True, "logprobs": 0})
                dt = time.perf_counter() - t
                total += dt
                answer = out["choices"][0]["logprobs"]["tokens"]
                print(f"rep {rep} {url} turn {turn}: prompt {len(prompt)} tokens, "
                      f"{cached(url) - before:.0f} from a kept cache, {dt * 1e3:.1f} ms")
                # The next prompt: this one, the answer (its text tokenized again, as a chat client
                # that resends the conversation does), a new message.
                answer_ids = json.loads(urllib.request.urlopen(urllib.request.Request(
                    url + "/tokenize", json.dumps({"prompt": "".join(answer),
                                                   "add_special_tokens": False}).encode(),
                    {"Content-Type": "application/json"})).read())["tokens"]
                prompt = prompt + answer_ids + tokens(a.message, 1000 * rep + turn + 2)
            totals[url].append(total)
    med = {u: statistics.median(v) for u, v in totals.items()}
    for u in urls:
        print(f"median conversation time {u}: {med[u] * 1e3:.1f} ms")
    if len(urls) == 2:
        print(f"ratio {urls[1]} / {urls[0]}: {med[urls[1]] / med[urls[0]]:.2f}")


if __name__ == "__main__":
    main()
