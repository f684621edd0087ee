#!/usr/bin/env bash
# Written in session 44 (the device was listed as lent late, then never started), for a device
# session, with the bundle made from the code it checks (tools/device_bundle.sh):
#   run(command="bash bench/cuda/pending/serving_check.sh", carry=[".device/bundle.tar.xz"])
# The GPU tests and the serve stage of tools/gpu_run.sh (with session 44's fork test, and the
# byte-level BPE fixture checked against the tokenizers package), then on `serve --device cuda`:
# n = 4 choices against the singles with seeds 7..10, and a two-turn chat whose second turn starts
# from the first's kept cache, each beside a server with --prefix-cache-bytes 0. Look at: gpu_run.txt
# (tests PASSED, bpe_check "agree"), features.txt (the n = 4 texts against the singles' on the off
# server: sampled, so a draw near a tie may differ in a batch; the greedy chat answers equal on and
# off; bitdelta_prompt_tokens_shared_total and bitdelta_prompt_tokens_cached_total > 0 on the server
# with kept caches). Run time not measured.
set -uo pipefail
out=${OUT:-/tmp/out}
BITDELTA_STAGES="tests serve" bash tools/gpu_run.sh "$out/run" > "$out/gpu_run.txt" 2>&1
echo "gpu_run rc=$?" >> "$out/gpu_run.txt"
root=$(pwd); bin=$root/.device/bin
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
log=$out/features.txt
"$bin/bitdelta" serve --device cuda --port 18090 --cache-dir /tmp/bd44 > /tmp/s_on.log 2>&1 &
p1=$!
"$bin/bitdelta" serve --device cuda --port 18091 --cache-dir /tmp/bd44b --prefix-cache-bytes 0 > /tmp/s_off.log 2>&1 &
p2=$!
for port in 18090 18091; do for _ in $(seq 1 240); do curl -sf localhost:$port/health >/dev/null && break; sleep 0.5; done; done
post() { curl -s localhost:$1/v1/$2 -H 'Content-Type: application/json' -d "$3"; echo; }
metric() { curl -s localhost:$1/metrics | grep -E "^bitdelta_(prompt_tokens_|prefix_cache)"; }
{
  echo "== n=4, seed 7, on (kept caches) and off"
  for port in 18090 18091; do post $port completions '{"model": "writer", "prompt": "The old house by the sea", "n": 4, "max_tokens": 12, "temperature": 0.8, "seed": 7, "ignore_eos": true}'; done
  echo "== singles with seeds 7..10 on the off server"
  for s in 7 8 9 10; do post 18091 completions "{\"model\": \"writer\", \"prompt\": \"The old house by the sea\", \"max_tokens\": 12, \"temperature\": 0.8, \"seed\": $s, \"ignore_eos\": true}"; done
  t1='{"model": "coder", "messages": [{"role": "system", "content": "You write short Python functions with docstrings."}, {"role": "user", "content": "Write a function that adds two numbers."}], "max_tokens": 16, "temperature": 0, "ignore_eos": true}'
  echo "== chat turn 1, on and off"
  for port in 18090 18091; do post $port chat/completions "$t1"; done
  a=$(post 18090 chat/completions "$t1" | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)["choices"][0]["message"]["content"]))')
  t2=$(python3 -c "import json,sys; t=json.loads(sys.argv[1]); t['messages'] += [{'role': 'assistant', 'content': json.loads(sys.argv[2])}, {'role': 'user', 'content': 'Now one that multiplies them.'}]; print(json.dumps(t))" "$t1" "$a")
  echo "== chat turn 2, on and off"
  for port in 18090 18091; do post $port chat/completions "$t2"; done
  echo "== metrics on"; metric 18090
  echo "== metrics off"; metric 18091
} > "$log" 2>&1
kill $p1 $p2; wait 2>/dev/null
tail -5 /tmp/s_on.log >> "$log"
cat "$out/gpu_run.txt" | tail -40
cat "$log" | cut -c1-400
