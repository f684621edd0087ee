BITDELTA_STAGES="kernels" timeout 280 tools/gpu_run.sh $OUT/r > /dev/null 2>&1; echo "rc $?"
ls $OUT/r
grep -E "a: 1 row 1 variant +balanced grid|alternating|b: 16 rows 16 variants stream( |, chain)|b: floor|c: 512 rows 1 variant +fused|32/8/128 +32 +520 auto|32/32/128 +32 +520 auto" $OUT/r/kernel_bench.log $OUT/r/attention_bench.log | cut -c1-140 | head -60
