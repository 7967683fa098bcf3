#!/usr/bin/env bash
# Fresh-machine entry point: needs only python3 (with venv and pip).
#   bash scripts/dev.sh run   -> install into .venv, then run the main job (jaxscale compare)
#   bash scripts/dev.sh test  -> install into .venv (with the test, tpu and tensorboard
#                                extras: the TPU target tests compile with libtpu, the
#                                TensorBoard test writes events), then run all tests
# Extra arguments go to the command: bash scripts/dev.sh run --steps 10 --json
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
hash="$(python3 -c "import hashlib; print(hashlib.sha256(open('pyproject.toml', 'rb').read()).hexdigest()[:16])")"

install() {  # install EXTRAS: "" for the main job, "[test,tpu,tensorboard]" for the tests
  local extras=$1 stamp="$venv/.installed-$hash${1//[^a-z]/-}"
  if [ ! -x "$venv/bin/python" ]; then
    echo "jaxscale: creating $venv" >&2
    python3 -m venv "$venv"
  fi
  if [ ! -f "$stamp" ]; then
    echo "jaxscale: installing jaxscale and its dependencies into $venv" >&2
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet -e ".$extras"
    rm -f "$venv"/.installed-*
    touch "$stamp"
  fi
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  run)  install ""; exec "$venv/bin/jaxscale" compare "$@" ;;
  test) install "[test,tpu,tensorboard]"; exec "$venv/bin/python" -m pytest -n 2 --dist worksteal "$@" ;;
  *)    echo "usage: bash scripts/dev.sh run|test [ARGS...]" >&2; exit 2 ;;
esac
