# --- installation-lock.sh, shared by gpulib.preinst and gpulib.prerm:
# --- debian/rules puts it in place of their placeholder line.

PKGDIR=/usr/lib/python3/dist-packages/gpulib
STATEDIR=/var/lib/gpulib
LOCK=$STATEDIR/state.lock
HOLDER=/run/gpulib-upgrade-lock.pid
# What the scripts did, for postinst and postrm (an abort) to finish or undo.
RUNDIR=/run/gpulib-upgrade

# hold_installation [state]: hold the installation until postinst or postrm
# (on an abort) lets go: the package directory's two flocks every gpulib run
# holds shared from its first line (gpulib/installation.py), and with
# "state" gpulib's state lock as well. A run that starts meanwhile waits,
# then starts again from the new files (an upgrade) or exits 3 with one line
# (a removal). Returns 1 when nothing is held (no flock(1), nothing installed,
# or the locks stayed busy for a minute).
hold_installation() {
    command -v flock >/dev/null 2>&1 || return 1
    pkg=
    [ -d "$PKGDIR/hooks" ] && pkg=$PKGDIR
    lock=
    if [ "${1:-}" = state ] && [ -d "$STATEDIR" ]; then
        [ -e "$LOCK" ] || (umask 077 && : >> "$LOCK")
        lock=$LOCK
    fi
    [ -n "$pkg$lock" ] || return 1
    mkdir -p "$RUNDIR"
    rm -f "$HOLDER"
    # One process holds the locks (open descriptors; flock(1) locks them)
    # until the package's last script kills it, or until dpkg (this script's
    # parent) is gone: a run that stopped halfway never leaves the hooks
    # locked out.
    # shellcheck disable=SC2016
    sh -c '
        if [ -n "$1" ]; then
            exec 7<"$1" 8<"$1/hooks"
            flock -w 60 7 && flock -w 60 8 || exit 1
        fi
        if [ -n "$2" ]; then
            exec 9>>"$2"
            flock -w 60 9 || exit 1
        fi
        echo $$ > "$3"
        i=0
        while [ "$i" -lt 600 ] && kill -0 "$4" 2>/dev/null; do
            sleep 1 7<&- 8<&- 9<&-
            i=$((i + 1))
        done' sh "$pkg" "$lock" "$HOLDER" "$PPID" </dev/null >/dev/null 2>&1 &
    holder=$!
    # Until it holds them (a hook ends within 30 s), or gave up after 60 s.
    i=0
    while [ ! -s "$HOLDER" ] && [ "$i" -lt 1250 ] && kill -0 "$holder" 2>/dev/null; do
        sleep 0.1
        i=$((i + 1))
    done
    if [ ! -s "$HOLDER" ]; then
        echo "gpulib: warning: gpulib's installation or state lock stayed busy for a minute: going on without waiting for the hooks" >&2
        return 1
    fi
    return 0
}

# refuse_downgrade NEWER OLDER [quiet]: exit 1, saying how to go back, when
# OLDER is older than NEWER and there is a state: the older gpulib restore may
# not read the newer state, and would then bring no vGPU back at boot.
# Without a state (moved aside, as the message says) going back is safe and
# goes through.
# The first build whose preinst refuses a downgrade only while there is a
# state (and so installs over a newer one's kept configuration files once the
# state is moved aside): 0.1.0 and 0.2.0.451 refuse any.
FIRST_STATE_REFUSAL=0.2.0.452
refuse_downgrade() {
    [ -n "$1" ] && [ -n "$2" ] || return 0
    dpkg --compare-versions "$1" gt "$2" || return 0
    [ -e "$STATEDIR/state.json" ] || [ -e "$STATEDIR/state.json.bak" ] || return 0
    [ "${3:-}" = quiet ] && exit 1
    echo "gpulib: refusing to replace gpulib $1 with the older $2: $2 may not read the state" >&2
    echo "gpulib: $1 keeps in $STATEDIR, and would then bring no vGPU back at boot." >&2
    if dpkg --compare-versions "$2" ge "$FIRST_STATE_REFUSAL"; then
        echo "gpulib: To go back anyway (your /etc/gpulib stays): apt-get remove gpulib; mv $STATEDIR $STATEDIR.$1; then install $2." >&2
    else
        # An older build's preinst refuses any install over the configuration
        # files a newer one's remove leaves, state or not: only a purge clears
        # them (tests/test_packaging.py runs every 0.2.0.N build's preinst).
        echo "gpulib: To go back anyway (your /etc/gpulib stays): mv /etc/gpulib /etc/gpulib.keep; mv $STATEDIR $STATEDIR.$1; apt-get purge gpulib; install $2; then rm -r /etc/gpulib; mv /etc/gpulib.keep /etc/gpulib." >&2
    fi
    exit 1
}
