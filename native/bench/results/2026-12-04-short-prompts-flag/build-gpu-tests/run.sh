# call A: the CUDA build of patches 0001-0032, packed for the next calls; its flag; the GPU prompt tests
source .carry/setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t=$SECONDS; python3 -m moeplug native build --cuda --cuda-arch 90 > $OUT/build.txt 2>&1; echo "build rc=$? $((SECONDS-t)) s"; tail -4 $OUT/build.txt
BIN=$(bin_dir); echo "BIN=$BIN"; ID=$(basename $(dirname $BIN))
$BIN/llama-server --help 2>&1 | grep -A3 "moe-cache-offload-min-batch"
t=$SECONDS; tar c -C ~/.local/share/moeplug/builds $ID | xz -T16 -6 | split -b 15M - $OUT/build.txz.; echo "pack $((SECONDS-t)) s"; ls -la $OUT
MOEPLUG_GPU_BIN=$BIN timeout $((570 - SECONDS)) python3 -m pytest -x tests/test_gpu_prompt.py -p no:cacheprovider -v 2>&1 | tee $OUT/gpu_prompt.txt | tail -14
echo "total $SECONDS s"
