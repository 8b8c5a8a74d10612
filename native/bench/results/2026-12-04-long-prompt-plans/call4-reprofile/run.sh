source .carry/setup.sh; BIN=$(bin_dir); CAR=$(basename $(dirname $BIN))
BID=$(python3 -c "from moeplug.native.build import build_id, resolve_options, load_spec; print(build_id(load_spec(), resolve_options(None, False, 0, None)))")
echo "carried $CAR resolved $BID"
[ -e ~/.local/share/moeplug/builds/$BID ] || ln -s ~/.local/share/moeplug/builds/$CAR ~/.local/share/moeplug/builds/$BID
t=$SECONDS; python3 -m moeplug dev make-model --shape gpt-oss-20b --out /tmp/gpt-oss-shape.gguf > /dev/null; echo "model rc=$? $((SECONDS-t)) s"
t=$SECONDS; python3 -m moeplug install /tmp/gpt-oss-shape.gguf --no-serve --vram-budget 6GiB --ctx 8192 --profile-tokens 64 > $OUT/install.txt 2>&1; echo "install rc=$? $((SECONDS-t)) s"; tail -3 $OUT/install.txt
NAME=$(python3 -m moeplug list --json | python3 -c "import json,sys; print(json.load(sys.stdin)['models'][0]['name'])"); echo "NAME=$NAME"
t=$SECONDS; python3 -m moeplug serve $NAME --record --json > $OUT/serve1.json 2>$OUT/serve1.err; echo "serve rc=$? $((SECONDS-t)) s"
python3 .carry/send.py $NAME 8 4000 64 > $OUT/send1.txt 2>&1; tail -1 $OUT/send1.txt
python3 -m moeplug status > $OUT/status1.txt 2>&1
t=$SECONDS; python3 -m moeplug reprofile $NAME --min-gain 1 --apply now > $OUT/reprofile.txt 2>&1; echo "reprofile rc=$? $((SECONDS-t)) s"; tail -4 $OUT/reprofile.txt
python3 -m moeplug list --json > $OUT/list2.json 2>&1
python3 .carry/send.py $NAME 8 4000 64 > $OUT/send2.txt 2>&1; tail -1 $OUT/send2.txt
python3 -m moeplug status > $OUT/status2.txt 2>&1; cat $OUT/status2.txt | tail -2
python3 -m moeplug stop --all; cp ~/.local/state/moeplug/logs/server-*.log $OUT/ 2>/dev/null; echo "total $SECONDS s"
