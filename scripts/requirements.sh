#!/usr/bin/env bash
# Sourced by the image scripts: xmig_requirements PYTHON PYPROJECT prints xmig's requirements
# (pyproject.toml's dependencies) less torch, one a line; torch's build is the caller's choice.
xmig_requirements() {
    "$1" - "$2" <<'EOF'
import re
import sys

text = open(sys.argv[1]).read()
block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
for req in re.findall(r'^\s*"([^"]+)"', block, re.M):
    if not re.match(r"torch\b", req):
        print(req)
EOF
}
