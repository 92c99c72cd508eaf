#!/usr/bin/env bash
# Prepare veRL 0.9.1's engine imports for the offline GPU machine (no package index there; Python 3.12,
# torch 2.11, transformers 5.17): the wheels of requirements-rl.txt's veRL block and verl itself, all
# installed there with --no-deps (veRL declares transformers<5.11: requirements-rl.txt says why).
#
#   tools/verl-wheels.sh [DIR]      (DIR defaults to .whl-verl; gitignored, never committed)
#
#   DIR/*.whl         the pinned set (tensordict, ray, peft, hydra-core, omegaconf, antlr4-python3-runtime,
#                     codetiming, verl), always installed;
#   DIR/deps/*.whl    what their imports pull in beyond torch and transformers (attrs, cloudpickle, jsonschema
#                     and its three, msgpack, orjson, protobuf, psutil, pyvers, colorama; datasets and its
#                     dill, multiprocess, xxhash, fsspec: veRL imports datasets, which the image lacks (.whl-trl
#                     brings it for trl-step); pyarrow, pandas and accelerate are on the image: trl-step ran
#                     with them), the versions this repository's CPU suite runs, installed only where the
#                     machine lacks the distribution (tests/gpu/device_run.sh's wheels step checks each one).
# antlr4-python3-runtime 4.9.3 (omegaconf's pin) has no wheel on PyPI: its sdist is built into a
# py3-none-any wheel here (pure Python). Everything else is --only-binary.
#
# A device call carries at most 64 MiB in all (tree and carried paths). If the wheels are over SPLIT_MIB
# (default 50) they are packed into one tar and split in two: DIR/a/part_aa (STAGE_MIB, default 50 MiB: the
# tree travels too) and DIR/b/part_ab (the rest), the way ../shared/tools/fa4-wheels.sh splits FA4:
#   call 1 (carry DIR/a):   tests/gpu/device_run.sh verl-stage            (part_aa -> /tmp/whl-verl)
#   call 2 (carry DIR/b):   WHEEL_DIRS=DIR tests/gpu/device_run.sh wheels verl-step
#                           (joins the parts, untars into /tmp/whl-verl/wheels, installs from there)
# The second call's other carried paths (the library) count against the same 64 MiB: part_ab is kept
# as small as the first call allows.
set -euo pipefail
DIR="${1:-.whl-verl}"
SPLIT_MIB="${SPLIT_MIB:-50}"; STAGE_MIB="${STAGE_MIB:-50}"
PY="${PYTHON:-python3}"
PINNED="tensordict==0.10.0 ray==2.60.0 peft==0.21.2 hydra-core==1.3.8 omegaconf==2.3.1 codetiming==1.4.0 verl==0.9.1"
DEPS="attrs==26.1.0 cloudpickle==3.1.3 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
      rpds-py==2026.9.1 msgpack==1.2.4 orjson==3.13.0 protobuf==7.36.2 psutil==7.2.2 pyvers==0.1.0 colorama==0.4.6
      datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 fsspec==2026.9.0"
PLAT="--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64"
rm -rf "$DIR" && mkdir -p "$DIR/deps"
get() {  # get DEST SPEC: the cp312 manylinux x86_64 wheel, or the py3 one of a pure-Python package
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d "$1" "$2"
}
for p in $PINNED; do get "$DIR" "$p"; done
for p in $DEPS; do get "$DIR/deps" "$p"; done
"$PY" -m pip wheel -q --no-deps -w "$DIR" antlr4-python3-runtime==4.9.3  # build isolation: the sdist needs setuptools + wheel, which a bare interpreter may lack
ls -la "$DIR"/*.whl "$DIR"/deps/*.whl | awk '{printf "%8.1f MiB  %s\n", $5 / 1048576, $NF}'
total=$(du -cb "$DIR"/*.whl "$DIR"/deps/*.whl | tail -1 | cut -f1)
echo "total $(( total / 1048576 )) MiB"
if [ "$total" -gt $(( SPLIT_MIB * 1048576 )) ]; then
  mkdir -p "$DIR/a" "$DIR/b"
  tar -C "$DIR" -cf "$DIR/wheels.tar" $(cd "$DIR" && ls *.whl deps/*.whl)
  split -b "${STAGE_MIB}M" -a 2 "$DIR/wheels.tar" "$DIR/a/part_"
  [ -f "$DIR/a/part_ac" ] && { echo "over two calls' worth (raise STAGE_MIB or stage a third part)"; exit 1; }
  mv "$DIR/a/part_ab" "$DIR/b/"
  rm -rf "$DIR/wheels.tar" "$DIR"/*.whl "$DIR/deps"
  echo "split: carry $DIR/a in the first call (verl-stage), $DIR/b in the second (wheels verl-step)"
fi
du -sh "$DIR"/* 
