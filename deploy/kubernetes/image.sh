#!/bin/sh
# The Dockerfile's install steps, in one script that `nox -s package` runs too (in fresh
# venvs, without a container engine: tools/check_package.py).
#
#   sh image.sh wheel OUTDIR                 (in a copy of the repository) build the wheel
#   sh image.sh install DISTDIR CONSTRAINTS [EXTRAS]
#                                            install that wheel with EXTRAS (default
#                                            metrics; e.g. metrics,record), every
#                                            package at its pin in CONSTRAINTS
#
# `python` is the image's interpreter (or the venv first on PATH).
set -eu

case "${1:-}" in
wheel)
    out="${2:?usage: image.sh wheel OUTDIR}"
    # build at its pin (constraints/ci.txt pins it as the dev extra does)
    python -m pip install --quiet -c constraints/ci.txt build
    python -m build --wheel --outdir "${out}" .
    ;;
install)
    dist="${2:?usage: image.sh install DISTDIR CONSTRAINTS}"
    constraints="${3:?usage: image.sh install DISTDIR CONSTRAINTS}"
    extras="${4:-metrics}"   # e.g. metrics,record (the Dockerfile's RLMESH_TRIO_EXTRAS)
    set -- "${dist}"/rlmesh_trio-*.whl
    if [ "$#" -ne 1 ] || [ ! -f "$1" ]; then
        echo "image.sh: expected one rlmesh_trio wheel in ${dist}" >&2
        exit 1
    fi
    python -m pip install --quiet -c "${constraints}" "$1[${extras}]"
    rlmesh-trio --version
    case ",${extras}," in *,metrics,*) python -c "import prometheus_client" ;; esac
    case ",${extras}," in *,record,*) python -c "import minari, h5py, av" ;; esac
    ;;
*)
    echo "usage: image.sh wheel OUTDIR | image.sh install DISTDIR CONSTRAINTS [EXTRAS]" >&2
    exit 2
    ;;
esac
