# The install and the bench at 8 GiB, in one call on the machine the calls before left warm: the scripts of
# ../install-12gib/ and ../bench-12gib/ (then in native/bench/device/queue/) with BUDGET=8.
export BUDGET=8; d=native/bench/results/2026-12-07-install-chooses-h100
bash $d/install-12gib/run.sh 2>&1; bash $d/bench-12gib/run.sh 2>&1
