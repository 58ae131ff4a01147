#!/bin/bash
# Installs what an offline GPU machine lacks from wheels carried beside the checkout (it reaches no
# package index): hydra, omegaconf, antlr, kvikio and, for bench_peers' peers, DeepSpeed with its pure
# Python dependencies and libaio (the .deb files unpacked with `dpkg -x`). Then this package, editable.
#
#   bash scripts/setup_gpu_machine.sh WHEEL_DIR [LIBAIO_ROOT]
#
# WHEEL_DIR: the *.whl files (../shared/wheels/device and ../shared/wheels/peers, copied into an ignored
# folder of the checkout that travels with it); LIBAIO_ROOT: where `dpkg -x libaio1_*.deb` and
# `dpkg -x libaio-dev_*.deb` unpacked (its usr/lib/x86_64-linux-gnu and usr/include); omit it to skip
# libaio (DeepSpeed's ZeRO-Infinity needs it, nothing else does).
set -euo pipefail
wheels=${1:?give the dir of the carried wheels}
python3 -m pip install -q --no-deps --no-index "$wheels"/*.whl
if [ -n "${2:-}" ]; then
  cp -a "$2"/usr/lib/x86_64-linux-gnu/libaio.so* /usr/local/lib/
  cp "$2"/usr/include/libaio.h /usr/local/include/
  ldconfig
fi
python3 -m pip install -q --no-deps --no-build-isolation -e "$(dirname "$0")/.."
