#!/usr/bin/env python3
"""n choices of one prompt (prefilled once, the other sequences continue from a copy of its cache)
against n requests of n different prompts of the same length sent at once (each prefilled), side by
side on one running `bitdelta serve`, repeated; prints the prompt tokens each ran (from /metrics),
the times, their medians and the ratio against its bound (n: the prompt work divided by n).

    build/bitdelta serve --port 18555 &
    python3 bench/prefill_sharing.py --url http://127.0.0.1:18555 [--n 8] [--prompt 400]
"""
import argparse
import json
import statistics
import threading
import time
import urllib.request


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--model", default="writer")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=400, help="prompt length in tokens (after BOS)")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()

    def post(body):
        req = urllib.request.Request(a.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req).read())

    def metric(name):
        for line in urllib.request.urlopen(a.url + "/metrics").read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise SystemExit(f"{name} is not in /metrics")

    def prompt(k):  # token ids: BOS, then `--prompt` ids that differ from one k to another
        return [1] + [(t * (k + 3)) % 3000 + 5 for t in range(100, 100 + a.prompt)]

    def counters():
        return (metric("bitdelta_prompt_tokens_run_total"),
                metric("bitdelta_prompt_tokens_shared_total"))

    common = {"model": a.model, "max_tokens": 4, "temperature": 0.8}
    one, many = [], []
    for rep in range(a.reps):
        r0, s0 = counters()
        t = time.perf_counter()
        post({**common, "prompt": prompt(0), "n": a.n, "seed": rep})
        one.append(time.perf_counter() - t)
        r1, s1 = counters()
        threads = [threading.Thread(target=post,
                                    args=({**common, "prompt": prompt(k + 1), "seed": rep},))
                   for k in range(a.n)]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        many.append(time.perf_counter() - t)
        r2, s2 = counters()
        print(f"rep {rep}: n={a.n} of one prompt {one[-1]:.3f} s (prompt tokens run {r1 - r0:.0f}, "
              f"shared {s1 - s0:.0f}); {a.n} prompts {many[-1]:.3f} s (run {r2 - r1:.0f}, "
              f"shared {s2 - s1:.0f})")
    ratio = statistics.median(many) / statistics.median(one)
    print(f"median: n={a.n} of one prompt {statistics.median(one):.3f} s, {a.n} prompts "
          f"{statistics.median(many):.3f} s; ratio {ratio:.2f} "
          f"(bound {a.n}: {ratio / a.n:.0%} of it)")


if __name__ == "__main__":
    main()
