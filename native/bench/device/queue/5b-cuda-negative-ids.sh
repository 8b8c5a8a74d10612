# Call 5b (issue 70 on the GPU machine, what call 5 left out): test-backend-ops' negative expert id cases on CUDA0
# against the CPU. Call 5 (run 2026-12-07-engine-move-h100) filtered on the op names MUL_MAT_ID and ADD_ID, which
# select upstream's cases only (931 and 36 passed); patch 0010 names its cases MUL_MAT_ID_SKIP_NEG, ADD_ID_SKIP_NEG
# and MUL_MAT_VEC_FUSION_SKIP_NEG (tests/test_vulkan.py runs them on lavapipe).
# Carry: .carry (sdist) and .whl. About 5 minutes (the CUDA build, then test-backend-ops in its build folder).
source native/bench/device/setup.sh || exit 1
t=$SECONDS; BIN=$(bin_dir) || exit 1; ID=$(basename $(dirname $BIN)); echo "BIN=$BIN build $((SECONDS-t)) s"
t=$SECONDS; cmake --build ~/.cache/moeplug/build/$ID -j 16 --target test-backend-ops > $OUT/ops-build.txt 2>&1 || { tail -5 $OUT/ops-build.txt; exit 1; }
echo "test-backend-ops build $((SECONDS-t)) s"
for op in MUL_MAT_ID_SKIP_NEG ADD_ID_SKIP_NEG MUL_MAT_VEC_FUSION_SKIP_NEG; do
    timeout 180 ~/.cache/moeplug/build/$ID/bin/test-backend-ops test -b CUDA0 -o $op > $OUT/ops-$op.txt 2>&1
    echo "$op rc=$? $(grep -E 'tests passed' $OUT/ops-$op.txt)"
done
echo "total $SECONDS s"
