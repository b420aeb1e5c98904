# Sourced by setup_env.sh and setup_vllm_env.sh: `venv_install VENV ARGS...` installs ARGS into VENV with uv
# (installed into the venv itself by pip; it resolves and unpacks in parallel, which makes the two venvs of
# `make test` about two minutes faster to build than pip did), or with pip where uv cannot be installed.
# uv reads no pip configuration: a wheel folder pip was pointed at ($PIP_FIND_LINKS) is passed on.
venv_install() {
  local venv=$1; shift
  if [ -x "$venv/bin/uv" ] || "$venv/bin/python" -m pip install -q uv; then
    local links=(); [ -n "${PIP_FIND_LINKS:-}" ] && links=(--find-links "$PIP_FIND_LINKS")
    "$venv/bin/uv" pip install -q --python "$venv/bin/python" "${links[@]}" "$@"
  else
    "$venv/bin/python" -m pip install -q "$@"
  fi
}
