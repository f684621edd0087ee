#!/usr/bin/env bash
# Installs the Debian packages bitdelta needs, and only the missing ones (DESIGN.md §6).
set -euo pipefail
packages=(cmake g++ ninja-build pkg-config libcli11-dev nlohmann-json3-dev libcpp-httplib-dev
  libsentencepiece-dev libpcre2-dev libxxhash-dev libopenblas-dev libgtest-dev libgmock-dev libbenchmark-dev ccache time)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
