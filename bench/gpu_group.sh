# Sourced by the GPU session scripts: $P (the gpu-marked pytest command); group(), which runs one command
# under its own time limit with its log in $out and prints a one-line summary and any failures; and
# session_start(), the scripts' common environment (newer scripts call it; older ones set it themselves).
P="python -m pytest -q -m gpu -p no:cacheprovider --tb=short -rfE"
group() {  # group LIMIT NAME CMD...: run, then print rc, seconds, the last line and any failures
  local lim=$1 name=$2 t0=$SECONDS
  shift 2
  timeout "$lim" "$@" >"$out/$name.log" 2>&1
  echo "== $name rc=$? $((SECONDS - t0))s: $(tail -1 "$out/$name.log")"
  grep -E "^(FAILED|ERROR)" "$out/$name.log" | head -8
}
session_start() {  # the session scripts' environment, $out (where group() writes its logs), the device
  export PYTHONUNBUFFERED=1 LUMO_CACHE_DIR=/tmp/lk PYTHONPATH=.:.gpu-deps
  out=${OUT:-/tmp}
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
}
