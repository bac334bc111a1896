#!/usr/bin/env bash
# Runs every fuzzer of a KILN_FUZZ build for a fixed time, two at a time, each on a scratch copy
# of its seed corpus (the checked-in one stays as it is). Prints each fuzzer's executions; on a
# finding, the fuzzer's report and the input (hex) that caused it, saved as crash-* under
# <build>/fuzz-runs/<target>/, and exits non-zero.
#   tests/fuzz/run.sh build-fuzz 30                  # every fuzzer, 30 s each
#   tests/fuzz/run.sh build-fuzz 600 flags idx       # some
set -euo pipefail
build=$(cd "$1" && pwd)
seconds=$2
shift 2
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(safetensors idx flags optim_state graph)
source_dir=$(cd "$(dirname "$0")" && pwd)
work=$build/fuzz-runs
mkdir -p "$work"

run_one() {
  local target=$1 dir=$work/$1
  rm -rf "$dir"
  mkdir -p "$dir/corpus"
  cp "$source_dir/corpus/$target/"* "$dir/corpus/"
  # -timeout: a JIT compile of a new kernel takes a while under ASan, but never a minute.
  if (cd "$dir" && KILN_CACHE_DIR="$build/kernel-cache" "$build/tests/fuzz/fuzz_$target" \
        -max_total_time="$seconds" -timeout=60 -rss_limit_mb=4096 -print_final_stats=1 corpus >log 2>&1); then
    echo "fuzz_$target: $(sed -n 's/^stat::number_of_executed_units: *//p' "$dir/log") executions in ${seconds} s, no findings"
  else
    echo "fuzz_$target: FINDING" >&2
    tail -n 60 "$dir/log" >&2
    for crash in "$dir"/crash-* "$dir"/leak-* "$dir"/timeout-* "$dir"/oom-*; do
      [ -e "$crash" ] && { echo "input $crash:" >&2; od -An -tx1 "$crash" | head -n 40 >&2; }
    done
    return 1
  fi
}
export -f run_one
export work seconds build source_dir
printf '%s\n' "${targets[@]}" | xargs -P 2 -I{} bash -c 'run_one {}'
