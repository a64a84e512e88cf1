# scripts/rmm_env.sh - sourced by scripts/gpu-test, scripts/rmm-suite and
# scripts/hooks-gpu: RMM (and cuda.core) for python3 and the folder dmem's
# build finds RMM's headers in.
#
#   dmem_rmm_env BUILD LOG
#
# When python3 imports rmm: RMMPY stays empty and RMM_ROOT is the
# site-packages folder of its librmm wheel. Otherwise the wheels carried in
# .whl/rmm (or .whl): librmm-cu*, rmm-cu*, rapids-logger, are installed with
# pip --no-deps --no-index into BUILD/rmm-py (nothing is downloaded), and
# cuda-core too when cuda.core does not import; RMMPY and RMM_ROOT are then
# that folder (put RMMPY on PYTHONPATH; pass -DDMEM_RMM_ROOT=$RMM_ROOT to
# cmake). Neither: both empty (nothing RMM-specific is built, its tests
# skip). pip's output goes to LOG. Returns 0 in every case.
dmem_rmm_env() {
  local build=$1 log=$2 dir whls core
  RMMPY=
  RMM_ROOT=
  command -v python3 >/dev/null || return 0
  if python3 -c "import rmm" 2>/dev/null; then
    RMM_ROOT=$(python3 -c "import librmm, os; print(os.path.dirname(os.path.dirname(librmm.__file__)))" \
               2>/dev/null)
    return 0
  fi
  for dir in .whl/rmm .whl; do
    shopt -s nullglob
    whls=("$dir"/librmm_cu*.whl "$dir"/rmm_cu*.whl "$dir"/rapids_logger-*.whl)
    core=("$dir"/cuda_core-*.whl)
    shopt -u nullglob
    (( ${#whls[@]} == 3 )) && break
  done
  if (( ${#whls[@]} != 3 )); then
    echo "rmm_env: RMM does not import and no librmm, rmm and rapids-logger wheels in .whl/rmm or .whl" >>"$log"
    return 0
  fi
  echo "rmm_env: installing ${whls[*]##*/} into $build/rmm-py" >>"$log"
  if ! python3 -m pip install --quiet --no-deps --no-index --target "$build/rmm-py" "${whls[@]}" \
       >>"$log" 2>&1; then
    echo "rmm_env: pip failed: RMM not used" >>"$log"
    return 0
  fi
  if ! python3 -c "import cuda.core" 2>/dev/null && (( ${#core[@]} )); then
    python3 -m pip install --quiet --no-deps --no-index --target "$build/rmm-py" "${core[@]}" \
      >>"$log" 2>&1 || echo "rmm_env: ${core[*]##*/} did not install (another Python?)" >>"$log"
  fi
  RMMPY=$build/rmm-py
  RMM_ROOT=$RMMPY
  return 0
}
