#!/usr/bin/env bash
# check_install.sh BUILD_DIR: installs the build into a temporary prefix and
# builds tests/install/consumer.c against it with CMake and with pkg-config.
set -euo pipefail
build=$1
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
libdir=$(ls -d "$tmp"/prefix/lib*/ | head -n1)
cmake -S "$here" -B "$tmp/consumer" -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
cmake --build "$tmp/consumer" >/dev/null
"$tmp/consumer/consumer"
export PKG_CONFIG_PATH="$libdir/pkgconfig"
# shellcheck disable=SC2046
cc -o "$tmp/consumer_pc" "$here/consumer.c" $(pkg-config --cflags --libs kpl)
LD_LIBRARY_PATH="$libdir" "$tmp/consumer_pc"
"$tmp/prefix/bin/kpl" --version
