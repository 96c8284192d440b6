# Sourced by the device scripts (from the repo root): the wheels the device image lacks (carried in .whl/, e.g.
# pydantic) installed into /tmp/site, and PYTHONPATH set so `import moestack` is this checkout. NO_WHL=1 skips the
# install.
if [ -z "${NO_WHL:-}" ] && [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
