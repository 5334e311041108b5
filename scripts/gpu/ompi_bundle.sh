#!/usr/bin/env bash
# ompi_bundle.sh DEST
#
# Copies the Debian 12 Open MPI 4.1 runtime that kpl's binaries are linked
# against (libmpi.so.40 from libopenmpi3) into DEST so that it runs from any
# path on another x86-64 Linux machine, whether it has no Open MPI/PMIx/
# libevent/hwloc at all or a different one (the Ubuntu 24.04 GPU image ships
# Open MPI 4.1.6 + PMIx 5 in /usr, which env.sh keeps out of the way: the host
# copy aborts our binaries' MPI_Init as a singleton). Run it here, on the Debian
# build host; copy DEST along with the rest of the kit; on the far side
#
#     . DEST/env.sh          # finds its own location (bash), or KIT=DEST . env.sh
#     ./prog                 # MPI singleton: MPI_Init fork-execs DEST/bin/orted
#     mpirun --allow-run-as-root -np 1 ./prog
#
# Everything is found from the installed packages, not guessed:
# `ompi_info --path` gives Open MPI's bindir/pkglibdir/pkgdatadir, the PMIx
# library is whatever the pmix component (mca_pmix_ext3x.so) resolves to, and
# `dpkg-query -L` of the package owning it gives PMIx's plugins and help files.
# Shared libraries are the `ldd` closure of what is copied, less glibc.
#
# Layout of DEST:
#   bin/           orterun (mpirun, mpiexec -> orterun), orted, ompi_info
#   lib/           libmpi, libopen-rte, libopen-pal, libmca_common_*, libpmix,
#                  libevent_core/_pthreads, libhwloc, libmunge
#   lib/fallback/  generic distro libraries the above need (libz, libudev);
#                  env.sh puts this on LD_LIBRARY_PATH only when the machine
#                  lacks them, so the host's own (newer) copies are not shadowed
#   lib/openmpi/   Open MPI MCA plugins (a subset, see deny_reason below)
#   lib/pmix/      PMIx MCA plugins
#   lib/hwloc/     empty on purpose (HWLOC_PLUGINS_PATH, see env.sh)
#   share/openmpi/ Open MPI help-*.txt (its show_help texts)
#   share/pmix/    PMIx help-*.txt
#   etc/           openmpi-mca-params.conf, pmix-mca-params.conf: site files,
#                  commented placeholders (Debian's live in /etc/openmpi and
#                  pmix2/share, which relocation does not move)
#   env.sh         the environment to source; MANIFEST: what came from where
#
# Plugin subset: every Open MPI plugin is kept unless (a) deny_reason names it
# (OpenSHMEM, monitoring, other resource managers, the ssh launcher, MTLs,
# stubs, ...), or
# (b) it needs a library outside the bundle (libucx, libfabric, libibverbs,
# libpsm*, libnl: verbs/ofi/ucx/psm transports, reachable_netlink). A plugin
# that is absent is simply never considered by Open MPI (no warning); a plugin
# present but with unloadable dependencies would print "unable to open
# component", which is why (b) is enforced and re-checked at the end.
#
# Checked (Nov 2026): with every Debian Open MPI/PMIx/libevent/hwloc/munge
# file (and libz, libudev, ssh) bind-mounted away in an `unshare -m`, the
# bundle copied elsewhere ran an MPI singleton, mpirun -np 1/2 and
# test_collective mpi with no warnings; likewise on the Ubuntu 24.04 GPU image.
#
# DEST is owned by this script: it is rebuilt from scratch in DEST.partial.PID
# and swapped in, so reruns are idempotent. An existing non-empty DEST that
# is not a previous bundle (no .ompi_bundle file) is refused, never deleted.
#
# Needs: bash, coreutils, ldd, ompi_info, dpkg-query. Optional: tar+zstd (size).
set -euo pipefail

die() { echo "ompi_bundle: $*" >&2; exit 1; }

[[ $# -eq 1 && -n $1 ]] || die "usage: $0 DEST"
for t in ompi_info ldd dpkg-query realpath; do
    command -v "$t" >/dev/null || die "$t not found (run this on the Debian build host)"
done

DEST=$(realpath -m -- "$1")
[[ $DEST != / ]] || die "DEST must not be /"
STAGE="$DEST.partial.$$"
trap 'rm -rf -- "$STAGE"' EXIT

ompi_path() {   # one of ompi_info's --path names -> its value
    local v
    v=$(ompi_info --parsable --path "$1" | sed -n "s|^path:$1:||p")
    [[ -n $v ]] || die "ompi_info --path $1 gave nothing"
    printf '%s\n' "$v"
}
BINDIR=$(ompi_path bindir)         # /usr/bin
PKGLIBDIR=$(ompi_path pkglibdir)   # /usr/lib/x86_64-linux-gnu/openmpi/lib/openmpi3
PKGDATADIR=$(ompi_path pkgdatadir) # /usr/share/openmpi
OMPI_VERSION=$(ompi_info --parsable | sed -n 's/^ompi:version:full://p')
[[ -n $OMPI_VERSION ]] || die "ompi_info gave no Open MPI version"

# glibc's own libraries come from the target machine, never from the bundle.
is_glibc() {
    case "$1" in
        linux-vdso.so.*|ld-linux*.so.*|libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|\
        librt.so.*|libmvec.so.*|libutil.so.*|libresolv.so.*|libanl.so.*|libnss_*|\
        libthread_db.so.*|libBrokenLocale.so.*) return 0 ;;
    esac
    return 1
}

# deps FILE: "soname<TAB>resolved-path" for each non-glibc library FILE needs,
# transitively (ldd resolves the whole tree); "soname<TAB>" when not found.
deps() {
    local out
    out=$(ldd "$1" 2>&1) || die "ldd $1 failed: $out"
    awk '$2 == "=>" { p = ($3 == "not") ? "" : $3; print $1 "\t" p }' <<<"$out" |
    while IFS=$'\t' read -r n p; do
        is_glibc "$n" || printf '%s\t%s\n' "$n" "$p"
    done
}

declare -A LIB=()   # soname -> source path, everything that goes to lib/ or lib/fallback/
add_deps_of() {     # FILE: add its library closure, failing on unresolved ones
    local n p
    while IFS=$'\t' read -r n p; do
        [[ -n $p ]] || die "$1 needs $n, which is not found on this host"
        LIB[$n]=$(realpath -- "$p")
    done < <(deps "$1")
}

# Open MPI's launcher/daemon, plus ompi_info to inspect the bundle on the target.
BINS=(orterun orted ompi_info)
for b in "${BINS[@]}"; do
    [[ -x $BINDIR/$b ]] || die "$BINDIR/$b missing (openmpi-bin installed?)"
    add_deps_of "$BINDIR/$b"
done
# libmpi itself, the way kpl's programs find it.
LIBMPI=$(ldd "$BINDIR/ompi_info" | awk '$1 == "libmpi.so.40" { print $3 }')
[[ -n $LIBMPI ]] || die "cannot locate libmpi.so.40 via ompi_info"
LIB[libmpi.so.40]=$(realpath -- "$LIBMPI")
add_deps_of "$LIBMPI"

# PMIx: Debian builds Open MPI against an external PMIx (libpmix2) that is only
# loaded through the pmix/ext3x plugin, so start from that plugin.
EXT3X="$PKGLIBDIR/mca_pmix_ext3x.so"
[[ -f $EXT3X ]] || die "$EXT3X missing"
LIBPMIX=$(ldd "$EXT3X" | awk '$1 ~ /^libpmix\.so\./ { print $3 }')
[[ -n $LIBPMIX ]] || die "cannot locate libpmix via $EXT3X"
LIBPMIX=$(realpath -- "$LIBPMIX")
PMIX_PKG=$(dpkg-query -S "$LIBPMIX" | head -n1 | cut -d: -f1)   # libpmix2
[[ -n $PMIX_PKG ]] || die "no package owns $LIBPMIX"
mapfile -t PMIX_PLUGINS < <(dpkg-query -L "$PMIX_PKG" | grep -E '/pmix_mca_[^/]+\.so$')
mapfile -t PMIX_HELP    < <(dpkg-query -L "$PMIX_PKG" | grep -E '/help-[^/]+\.txt$')
(( ${#PMIX_PLUGINS[@]} )) || die "no PMIx plugins listed by $PMIX_PKG"
(( ${#PMIX_HELP[@]} ))    || die "no PMIx help files listed by $PMIX_PKG"
add_deps_of "$LIBPMIX"
for f in "${PMIX_PLUGINS[@]}"; do add_deps_of "$f"; done

# The "core" closure: a plugin may only need these (or libmca_common_*).
declare -A CORE=()
for n in "${!LIB[@]}"; do CORE[$n]=1; done

# Plugins left out by name. Absent plugins are invisible to Open MPI; each of
# these is either unused by a single-node MPI job or replaced by a kept one.
deny_reason() {     # framework_component -> reason (status 0) or status 1 (keep)
    case "$1" in
        atomic_*|memheap_*|scoll_*|spml_*|sshmem_*)
            echo "OpenSHMEM only (liboshmem)" ;;
        *_monitoring)
            echo "monitoring/profiling layer, off unless explicitly requested" ;;
        *_slurm|*_flux|schizo_jsm|ras_gridengine|ras_simulator)
            echo "other resource managers; the kit is single-node, launched locally" ;;
        pml_cm|mtl_*)
            echo "pml cm drives MTLs, and every MTL needs psm/psm2/libfabric; ob1 is used" ;;
        plm_rsh)
            echo "starts remote daemons over ssh/rsh (multi-node only); on a host without ssh it aborts mpirun with a plm_rsh_agent error, and plm isolated covers local launches" ;;
        btl_sm)
            echo "4.1 stub whose only job is to say 'sm was renamed vader'" ;;
        osc_pt2pt)
            echo "disabled by Debian's own openmpi-mca-params.conf (osc = ^ucx,pt2pt)" ;;
        io_romio321)
            echo "MPI-IO is served by ompio (Open MPI 4.1's default io component)" ;;
        vprotocol_*)
            echo "message-logging fault tolerance, only when explicitly enabled" ;;
        *) return 1 ;;
    esac
}

KEPT=() SKIPPED=()
for so in "$PKGLIBDIR"/mca_*.so; do
    comp=$(basename "$so" .so); comp=${comp#mca_}
    if reason=$(deny_reason "$comp"); then
        SKIPPED+=("$comp: $reason"); continue
    fi
    bad=()
    while IFS=$'\t' read -r n p; do
        if [[ -z $p ]]; then bad+=("$n(not found)")
        elif [[ -z ${CORE[$n]:-} && $n != libmca_common_* ]]; then bad+=("$n")
        fi
    done < <(deps "$so")
    if (( ${#bad[@]} )); then
        SKIPPED+=("$comp: needs ${bad[*]}"); continue
    fi
    KEPT+=("$so")
    add_deps_of "$so"          # picks up libmca_common_sm, libmca_common_ompio
done

# Split libraries: Open MPI's own stack (absent on the target) -> lib/;
# generic distro libraries the target normally has -> lib/fallback/.
is_core_lib() {
    [[ $1 =~ ^lib(mpi|open-rte|open-pal|mca_common_|pmix|hwloc|event|munge) ]]
}

# ---------------------------------------------------------------- build STAGE
rm -rf -- "$STAGE"
mkdir -p "$STAGE"/{bin,lib/fallback,lib/openmpi,lib/pmix,lib/hwloc,share/openmpi,share/pmix,etc}

for b in "${BINS[@]}"; do cp -L -- "$BINDIR/$b" "$STAGE/bin/$b"; done
ln -s orterun "$STAGE/bin/mpirun"
ln -s orterun "$STAGE/bin/mpiexec"

for n in "${!LIB[@]}"; do
    if is_core_lib "$n"; then cp -L -- "${LIB[$n]}" "$STAGE/lib/$n"
    else cp -L -- "${LIB[$n]}" "$STAGE/lib/fallback/$n"; fi
done

for so in "${KEPT[@]}"; do cp -L -- "$so" "$STAGE/lib/openmpi/"; done
for so in "${PMIX_PLUGINS[@]}"; do cp -L -- "$so" "$STAGE/lib/pmix/"; done
cp -L -- "$PKGDATADIR"/help-*.txt "$STAGE/share/openmpi/"
for h in "${PMIX_HELP[@]}"; do cp -L -- "$h" "$STAGE/share/pmix/"; done

cat > "$STAGE/etc/openmpi-mca-params.conf" <<'EOF'
# Site-wide Open MPI MCA parameters of this bundle (OPAL_SYSCONFDIR points
# here). env.sh already sets the bundle's choices as OMPI_MCA_* variables,
# which take precedence over this file; add "name = value" lines here only for
# settings that should apply to every user of the bundle.
EOF
cat > "$STAGE/etc/pmix-mca-params.conf" <<'EOF'
# Site-wide PMIx MCA parameters of this bundle (PMIX_SYSCONFDIR points here).
# The plugin path is set by env.sh (PMIX_MCA_mca_base_component_path).
EOF

cat > "$STAGE/env.sh" <<'EOF'
# Source this file (". /path/to/kit/env.sh") to use the relocated Open MPI.
# In bash it finds its own directory; in other shells set KIT first
# ("KIT=/path/to/kit . /path/to/kit/env.sh"). Sourcing twice is harmless.
if [ -n "${BASH_SOURCE:-}" ]; then
    KPL_OMPI_KIT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
elif [ -n "${KIT:-}" ] && [ -f "$KIT/env.sh" ]; then
    KPL_OMPI_KIT=$(cd "$KIT" && pwd -P)
else
    echo "env.sh: cannot tell where the kit is; source it from bash or set KIT" >&2
    return 1 2>/dev/null || exit 1
fi
export KPL_OMPI_KIT

_kpl_prepend() {  # VAR DIR: put DIR first in the colon list VAR, once
    eval "_kpl_v=\${$1:-}"
    case ":$_kpl_v:" in *":$2:"*) ;; *) eval "export $1=\"$2\${_kpl_v:+:\$_kpl_v}\"" ;; esac
    unset _kpl_v
}
_kpl_prepend PATH "$KPL_OMPI_KIT/bin"
# lib/fallback holds generic distro libraries (libz, libudev): used only for
# the ones this machine lacks, so that its own copies are not shadowed.
for _kpl_f in "$KPL_OMPI_KIT"/lib/fallback/*.so*; do
    [ -e "$_kpl_f" ] || continue
    _kpl_n=${_kpl_f##*/}
    _kpl_have=
    for _kpl_d in /lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu /lib64 /usr/lib64 /lib /usr/lib; do
        if [ -s "$_kpl_d/$_kpl_n" ]; then _kpl_have=1; break; fi
    done
    if [ -z "$_kpl_have" ]; then
        _kpl_prepend LD_LIBRARY_PATH "$KPL_OMPI_KIT/lib/fallback"
        break
    fi
done
unset _kpl_f _kpl_n _kpl_have _kpl_d
_kpl_prepend LD_LIBRARY_PATH "$KPL_OMPI_KIT/lib"
unset -f _kpl_prepend

# Open MPI install dirs. OPAL_PREFIX relocates the prefix-relative ones
# (bindir = $OPAL_PREFIX/bin: where the MPI singleton looks for orted;
# datadir). Debian's libdir/pkglibdir are not plain $prefix/lib, and its
# sysconfdir (/etc/openmpi) is absolute, so those are set one by one.
export OPAL_PREFIX="$KPL_OMPI_KIT"
export OPAL_LIBDIR="$KPL_OMPI_KIT/lib"
export OPAL_PKGLIBDIR="$KPL_OMPI_KIT/lib/openmpi"     # MCA plugins
export OPAL_PKGDATADIR="$KPL_OMPI_KIT/share/openmpi"  # help-*.txt
export OPAL_SYSCONFDIR="$KPL_OMPI_KIT/etc"            # openmpi-mca-params.conf

# PMIx install dirs (read by its pinstalldirs/env component). Debian's PMIx
# has absolute libdir/datadir/sysconfdir under /usr/lib/x86_64-linux-gnu/pmix2.
export PMIX_PREFIX="$KPL_OMPI_KIT"
export PMIX_LIBDIR="$KPL_OMPI_KIT/lib"
export PMIX_PKGLIBDIR="$KPL_OMPI_KIT/lib/pmix"        # PMIx plugins
export PMIX_DATADIR="$KPL_OMPI_KIT/share"
export PMIX_PKGDATADIR="$KPL_OMPI_KIT/share/pmix"     # PMIx help-*.txt
export PMIX_SYSCONFDIR="$KPL_OMPI_KIT/etc"            # pmix-mca-params.conf
# Debian sets the plugin path in its own pmix-mca-params.conf; say it here.
export PMIX_MCA_mca_base_component_path="$KPL_OMPI_KIT/lib/pmix"

# hwloc 2.9 (bundled) would otherwise dlopen the host's hwloc plugins
# (/usr/lib/x86_64-linux-gnu/hwloc, possibly another hwloc version); point it
# at an empty directory. Open MPI needs no PCI/GL/OpenCL topology.
export HWLOC_PLUGINS_PATH="$KPL_OMPI_KIT/lib/hwloc"

# Component choices (the bundle only ships these anyway; naming them makes a
# missing one an error instead of a silent change of transport).
export OMPI_MCA_pml=ob1
export OMPI_MCA_btl=self,vader,tcp
# Local launches only: never look for ssh/rsh (the target has none).
export OMPI_MCA_plm=isolated
# vader's single-copy path uses CMA (process_vm_readv), which containers
# without CAP_SYS_PTRACE refuse mid-run; use copy-in/copy-out instead.
export OMPI_MCA_btl_vader_single_copy_mechanism=none
# Debian's own /etc/openmpi default (no warning for unused BTLs).
export OMPI_MCA_btl_base_warn_component_unused=0
EOF

{
    echo "# ompi_bundle.sh manifest (built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname))"
    echo "# Open MPI $OMPI_VERSION; packages:"
    dpkg-query -W -f='#   ${Package} ${Version}\n' openmpi-bin libopenmpi3 openmpi-common "$PMIX_PKG"
    echo "# ompi_info --path: bindir=$BINDIR pkglibdir=$PKGLIBDIR pkgdatadir=$PKGDATADIR"
    echo "# libraries (soname <- source):"
    for n in $(printf '%s\n' "${!LIB[@]}" | sort); do echo "lib  $n <- ${LIB[$n]}"; done
    echo "# Open MPI plugins kept: ${#KEPT[@]}; skipped:"
    printf 'skip %s\n' "${SKIPPED[@]}"
} > "$STAGE/MANIFEST"

# ------------------------------------------------------------------- verify
# Every ELF file of the bundle must resolve all its non-glibc libraries inside
# the bundle (LD_LIBRARY_PATH is searched before the host's cache, so a
# library resolved elsewhere means one was forgotten).
verify_errors=0
while IFS= read -r -d '' f; do
    [[ $(head -c4 -- "$f" | od -An -c | tr -d ' ') == 177ELF ]] || continue
    while IFS=$'\t' read -r n p; do
        case "$p" in
            "$STAGE"/lib/*) ;;
            *) echo "ompi_bundle: $f: $n resolves to '${p:-not found}'" >&2
               verify_errors=$((verify_errors + 1)) ;;
        esac
    done < <(LD_LIBRARY_PATH="$STAGE/lib:$STAGE/lib/fallback" deps "$f")
done < <(find "$STAGE" -type f -print0)
(( verify_errors == 0 )) || die "$verify_errors unresolved libraries; bundle not installed"
: > "$STAGE/.ompi_bundle"

# ------------------------------------------------------------------ install
if [[ -e $DEST || -L $DEST ]]; then
    if [[ -f $DEST/.ompi_bundle ]] || [[ -d $DEST && -z $(ls -A -- "$DEST") ]]; then
        rm -rf -- "$DEST"
    else
        die "$DEST exists and is not an earlier bundle; not replacing it"
    fi
fi
mkdir -p -- "$(dirname -- "$DEST")"
mv -- "$STAGE" "$DEST"
trap - EXIT

echo "ompi_bundle: Open MPI $OMPI_VERSION bundled into $DEST"
echo "  binaries: ${BINS[*]} (+ mpirun, mpiexec -> orterun)"
echo "  libraries: $(cd "$DEST/lib" && ls *.so* | tr '\n' ' ')"
echo "  fallback libraries: $(cd "$DEST/lib/fallback" && ls | tr '\n' ' ')"
echo "  Open MPI plugins: ${#KEPT[@]} kept, ${#SKIPPED[@]} left out (see $DEST/MANIFEST)"
echo "  PMIx plugins: ${#PMIX_PLUGINS[@]}; help files: $(ls "$DEST/share/openmpi" | wc -l) + $(ls "$DEST/share/pmix" | wc -l)"
echo "  size: $(du -sh -- "$DEST" | cut -f1)"
if command -v zstd >/dev/null; then
    echo "  tar | zstd -19: $(tar -C "$(dirname -- "$DEST")" -cf - "$(basename -- "$DEST")" | zstd -19 -q -c | wc -c) bytes"
fi
echo
echo "Use it with:  . $DEST/env.sh    (after copying: . NEWPLACE/env.sh), which sets:"
grep -E '^ *(export |_kpl_prepend )' "$DEST/env.sh" | sed -e 's/^ */  /' \
    -e '/lib\/fallback"$/s/$/   # only if the host lacks one of lib\/fallback\/*/'
