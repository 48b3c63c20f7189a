#!/bin/sh
# Preloads Debian's OpenBLAS when present (MLX's Linux wheel bundles a slower reference BLAS),
# whatever the architecture, then runs `mixbit` with the container's arguments.
set -e
for lib in /usr/lib/*/openblas-pthread/libopenblas.so.0; do
  if [ -e "$lib" ]; then
    export LD_PRELOAD="$lib${LD_PRELOAD:+:$LD_PRELOAD}"
    break
  fi
done
exec mixbit "$@"
