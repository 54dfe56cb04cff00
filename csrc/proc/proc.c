/*
 * Internal to mongolock: the command's, not an API; it may change without
 * notice.
 *
 * luaopen_mongolock_proc: child processes and signals for the mongolock
 * command (bin/mongolock), a module of its own so that the library every
 * nginx worker loads (mongolock.core) spawns nothing.  No libmongoc here.
 *
 *   proc.trap()                  catch SIGINT, SIGTERM, SIGHUP (and SIGCHLD)
 *   proc.untrap()                back to their default disposition
 *   proc.signals()               -> {{name=, tty=}, ...} caught since last call
 *   proc.spawn(argv[, env])      -> pid, tty | nil, message, errno
 *   proc.wait(pid, timeout[, s]) -> "exit", code | "signal", name, signo | false
 *   proc.kill(pid, name)         -> true | nil, message, errno
 *   proc.wait_group(pid, timeout) -> true (the group is empty) | false
 *   proc.wait_input(timeout)     -> "eof" | "data" | false | nil (stdin not watched)
 *   proc.isatty(fd)              -> boolean
 *
 * Invariants:
 * - A spawned child leads a process group of its own (pgid = its pid), and
 *   proc.kill signals that whole group: whatever the child starts (a shell's
 *   background jobs, a pipeline) gets the signal too, unless it left the
 *   group (setsid, setpgid).
 * - When this process is the foreground process group of its terminal, the
 *   child's group is made the foreground group before it execs (spawn's
 *   second result is then true): the terminal's keys (^C, ^Z, ^\) go to the
 *   child's group and it may read the terminal.  proc.wait hands the
 *   terminal back once the child has ended, and follows a stop (^Z) the way
 *   a shell's job does: it takes the terminal back, stops this process (so
 *   the shell sees the job stopped), and on SIGCONT gives the terminal to
 *   the child's group and continues it.  With no job-control shell above
 *   (mongolock leads its session: ssh -t, script -c) the child is continued
 *   at once.
 * - Signal handlers only set a flag and write one byte to a non-blocking
 *   self-pipe (async-signal-safe); whichever thread runs the handler (the
 *   driver's threads included), the byte wakes proc.wait's poll().
 * - proc.wait never misses a wake-up: it drains the pipe before it looks at
 *   the child and the flags, so a signal arriving after the look leaves a
 *   byte that makes the next poll() return at once.
 * - The command makes itself a child subreaper (Linux) before it spawns
 *   (proc.subreaper): what the child's processes leave orphaned is
 *   reparented here, not to pid 1, and proc.wait_group reaps those of the
 *   child's group as they end, so an ended member never lingers as a zombie
 *   of an init that reaps late.  Only on request: a process that spawns
 *   daemons it does not reap (a test runner starting nginx) must not
 *   become their parent.
 * - A spawned child starts with every signal unblocked and the trapped ones
 *   (and SIGTTOU, which proc.trap ignores) at their default disposition;
 *   the pipe is close-on-exec.
 */
#define _GNU_SOURCE             /* pipe2, posix_spawn_file_actions_addtcsetpgrp_np */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include "compat.h"

extern char **environ;

static const struct { int sig; const char *name; } signames[] = {
  {SIGHUP, "HUP"}, {SIGINT, "INT"}, {SIGQUIT, "QUIT"}, {SIGKILL, "KILL"},
  {SIGTERM, "TERM"}, {SIGUSR1, "USR1"}, {SIGUSR2, "USR2"}, {SIGPIPE, "PIPE"},
  {SIGALRM, "ALRM"}, {SIGCHLD, "CHLD"}, {SIGSEGV, "SEGV"}, {SIGABRT, "ABRT"},
  {SIGCONT, "CONT"}, {SIGSTOP, "STOP"}, {SIGTSTP, "TSTP"}, {SIGBUS, "BUS"},
  {SIGFPE, "FPE"}, {SIGILL, "ILL"}, {SIGTRAP, "TRAP"}, {SIGSYS, "SYS"},
  {SIGTTIN, "TTIN"}, {SIGTTOU, "TTOU"},
  {0, NULL}
};

/* the signals proc.trap catches and proc.signals reports */
static const int trapped[] = {SIGINT, SIGTERM, SIGHUP};
#define NTRAPPED (sizeof trapped / sizeof trapped[0])

static int wake_pipe[2] = {-1, -1};
/* between proc.trap and proc.untrap: SIGCHLD writes to the pipe */
static int trapping = 0;
/* per trapped signal: sent by a process (kill) / by the kernel (a tty) */
static volatile sig_atomic_t caught_user[NTRAPPED], caught_tty[NTRAPPED];

/* the terminal given to a child's group (-1: none), and that group */
static int tty_fd = -1;
static pid_t tty_pgrp = 0;

static double monotonic(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static const char *signame(int sig) {
  int i;
  for (i = 0; signames[i].name; i++)
    if (signames[i].sig == sig) return signames[i].name;
  return NULL;
}

static void on_signal(int sig, siginfo_t *info, void *ctx) {
  int saved = errno;
  size_t i;
  char b = 0;
  (void)ctx;
  for (i = 0; i < NTRAPPED; i++) {
    if (trapped[i] != sig) continue;
    /* a terminal's key reaches its foreground process group: the kernel
     * sends it with si_code SI_KERNEL */
    if (info && info->si_code == SI_KERNEL) caught_tty[i] = 1;
    else caught_user[i] = 1;
  }
  if (wake_pipe[1] >= 0 && write(wake_pipe[1], &b, 1) < 0) {
    /* full pipe: a wake-up is already pending */
  }
  errno = saved;
}

static void drain_pipe(void) {
  char buf[64];
  if (wake_pipe[0] < 0) return;
  while (read(wake_pipe[0], buf, sizeof buf) > 0) {}
}

/* makes pgrp the foreground group of fd; SIGTTOU blocked in this thread, as
 * a process outside the foreground group would otherwise be stopped */
static void give_tty(int fd, pid_t pgrp) {
  sigset_t ttou, old;
  sigemptyset(&ttou);
  sigaddset(&ttou, SIGTTOU);
  pthread_sigmask(SIG_BLOCK, &ttou, &old);
  if (tcsetpgrp(fd, pgrp) != 0) {
    /* the terminal is gone (hangup): nothing to hand back */
  }
  pthread_sigmask(SIG_SETMASK, &old, NULL);
}

/* the terminal back to this process's group, if a child had it */
static void reclaim_tty(void) {
  if (tty_fd < 0) return;
  give_tty(tty_fd, getpgrp());
  tty_fd = -1;
  tty_pgrp = 0;
}

/* the first of stdin, stdout, stderr that is a terminal whose foreground
 * group is this process's; -1 when there is none */
static int foreground_tty(void) {
  int fd;
  for (fd = 0; fd <= 2; fd++)
    if (isatty(fd) && tcgetpgrp(fd) == getpgrp()) return fd;
  return -1;
}

/* proc.trap(): installs the handlers (idempotent), and ignores SIGTTOU */
static int l_trap(lua_State *L) {
  struct sigaction sa;
  size_t i;
  if (wake_pipe[0] < 0) {
    if (pipe2(wake_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
      wake_pipe[0] = wake_pipe[1] = -1;
      return luaL_error(L, "pipe: %s", strerror(errno));
    }
  }
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_signal;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  for (i = 0; i < NTRAPPED; i++)
    sigaction(trapped[i], &sa, NULL);
  sa.sa_flags |= SA_NOCLDSTOP;
  sigaction(SIGCHLD, &sa, NULL);
  /* this process writes its messages to the terminal while a child's
   * group has it: never stopped for that, even under stty tostop */
  sa.sa_handler = SIG_IGN;
  sa.sa_flags = 0;
  sigaction(SIGTTOU, &sa, NULL);
  trapping = 1;
  return 0;
}

/* proc.untrap(): the trapped signals, SIGCHLD and SIGTTOU back to their
 * default disposition (the pipe stays for a later proc.trap) */
static int l_untrap(lua_State *L) {
  struct sigaction sa;
  size_t i;
  (void)L;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = SIG_DFL;
  sigemptyset(&sa.sa_mask);
  for (i = 0; i < NTRAPPED; i++)
    sigaction(trapped[i], &sa, NULL);
  sigaction(SIGCHLD, &sa, NULL);
  sigaction(SIGTTOU, &sa, NULL);
  trapping = 0;
  return 0;
}

/* proc.signals() -> array of {name = "INT", tty = boolean}, clearing them.
 * tty is true when only the kernel sent it (a terminal key or hangup). */
static int l_signals(lua_State *L) {
  size_t i;
  int n = 0;
  lua_newtable(L);
  for (i = 0; i < NTRAPPED; i++) {
    int user = caught_user[i], tty = caught_tty[i];
    caught_user[i] = 0;
    caught_tty[i] = 0;
    if (!user && !tty) continue;
    lua_createtable(L, 0, 2);
    lua_pushstring(L, signame(trapped[i]));
    lua_setfield(L, -2, "name");
    lua_pushboolean(L, !user);
    lua_setfield(L, -2, "tty");
    lua_rawseti(L, -2, ++n);
  }
  return 1;
}

static int push_errno(lua_State *L, const char *what, int err) {
  lua_pushnil(L);
  lua_pushfstring(L, "%s: %s", what, strerror(err));
  lua_pushinteger(L, err);
  return 3;
}

/* is entry ("NAME=value") one of the names set in the table at index t? */
static int overridden(lua_State *L, int t, const char *entry) {
  const char *eq = strchr(entry, '=');
  int found;
  if (!eq) return 0;
  lua_pushlstring(L, entry, (size_t)(eq - entry));
  lua_rawget(L, t);
  found = !lua_isnil(L, -1);
  lua_pop(L, 1);
  return found;
}

/* [-0, +2] pushes the child's environment: this process's environ, each
 * name of the table at index t (string -> string) replaced or added; the
 * array (a userdata, NULL-terminated) is at -1, the table of its
 * "NAME=value" strings that keeps them alive at -2 */
static char **child_environ(lua_State *L, int t) {
  size_t n = 0, k = 0, i;
  char **envp;
  lua_newtable(L);                                  /* the strings */
  for (i = 0; environ[i]; i++) n++;
  lua_pushnil(L);
  while (lua_next(L, t)) {
    if (lua_type(L, -2) != LUA_TSTRING || lua_type(L, -1) != LUA_TSTRING ||
        strchr(lua_tostring(L, -2), '=') || lua_tostring(L, -2)[0] == '\0')
      luaL_argerror(L, 2, "table of NAME = string expected");
    k++;
    lua_pop(L, 1);
  }
  envp = (char **)lua_newuserdata(L, (n + k + 1) * sizeof *envp);
  k = 0;
  for (i = 0; i < n; i++)
    if (!overridden(L, t, environ[i])) envp[k++] = environ[i];
  lua_pushnil(L);
  while (lua_next(L, t)) {
    lua_pushfstring(L, "%s=%s", lua_tostring(L, -2), lua_tostring(L, -1));
    envp[k++] = (char *)lua_tostring(L, -1);
    lua_rawseti(L, -5, (int)k);                     /* kept in the strings table */
    lua_pop(L, 1);
  }
  envp[k] = NULL;
  return envp;
}

/* proc.spawn(argv[, env]) -> pid, tty | nil, message, errno.  argv: an
 * array of strings, argv[1] looked up in PATH; env: variables to set in the
 * child's environment (the rest is this process's).  The child leads a new
 * process group; tty is true when it was given the terminal (see the
 * invariants).  errno ENOENT / EACCES tell "not found" from "not
 * executable". */
static int l_spawn(lua_State *L) {
  posix_spawnattr_t attr;
  posix_spawn_file_actions_t fa;
  sigset_t none, dflt;
  char **argv, **envp = environ;
  size_t i, n;
  pid_t pid;
  int err, fd;
  luaL_checktype(L, 1, LUA_TTABLE);
  if (!lua_isnoneornil(L, 2)) {
    luaL_checktype(L, 2, LUA_TTABLE);
    envp = child_environ(L, 2);                     /* [-0, +2], kept on the stack */
  }
  n = (size_t)lua_rawlen(L, 1);
  luaL_argcheck(L, n > 0, 1, "empty command");
  argv = (char **)lua_newuserdata(L, (n + 1) * sizeof *argv); /* kept on the stack */
  for (i = 0; i < n; i++) {
    lua_rawgeti(L, 1, (int)i + 1);
    if (lua_type(L, -1) != LUA_TSTRING)
      return luaL_argerror(L, 1, "array of strings expected");
    argv[i] = (char *)lua_tostring(L, -1);
    lua_pop(L, 1);  /* the string stays alive in the table */
  }
  argv[n] = NULL;

  sigemptyset(&none);
  sigemptyset(&dflt);
  for (i = 0; i < NTRAPPED; i++) sigaddset(&dflt, trapped[i]);
  sigaddset(&dflt, SIGCHLD);
  sigaddset(&dflt, SIGPIPE);
  sigaddset(&dflt, SIGTTOU);
  if ((err = posix_spawnattr_init(&attr)) != 0)
    return push_errno(L, "posix_spawnattr_init", err);
  if ((err = posix_spawn_file_actions_init(&fa)) != 0) {
    posix_spawnattr_destroy(&attr);
    return push_errno(L, "posix_spawn_file_actions_init", err);
  }
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &dflt);
  posix_spawnattr_setpgroup(&attr, 0);         /* a group of its own */
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF |
                                  POSIX_SPAWN_SETPGROUP);
  /* the child takes the terminal itself, before exec, so that it never
   * reads it from a background group (glibc runs the action with every
   * signal blocked, SIGTTOU included) */
  fd = foreground_tty();
  if (fd >= 0) posix_spawn_file_actions_addtcsetpgrp_np(&fa, fd);
  err = posix_spawnp(&pid, argv[0], &fa, &attr, argv, envp);
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  if (err != 0) {
    if (fd >= 0) give_tty(fd, getpgrp());  /* a child that failed may have taken it */
    return push_errno(L, argv[0], err);
  }
  if (fd >= 0) {
    tty_fd = fd;
    tty_pgrp = pid;
  }
  lua_pushinteger(L, (lua_Integer)pid);
  lua_pushboolean(L, fd >= 0);
  return 2;
}

static int any_caught(void) {
  size_t i;
  for (i = 0; i < NTRAPPED; i++)
    if (caught_user[i] || caught_tty[i]) return 1;
  return 0;
}

/* does a shell with job control (the parent, in this session, in another
 * group) look after this process's group?  Without one the group is
 * orphaned: the kernel discards ^Z for it, and nobody would continue it */
static int job_control_parent(void) {
  pid_t pp = getppid(), ppg = getpgid(pp);
  return ppg >= 0 && ppg != getpgrp() && getsid(pp) == getsid(0);
}

/* the child stopped (^Z at its terminal, SIGSTOP): stop this process too,
 * as a shell's job, and continue the child when this process is continued;
 * with no job-control shell above, continue the child at once (as the
 * kernel treats ^Z in an orphaned group) */
static void follow_stop(pid_t pid) {
  int fd = tty_fd;
  if (!job_control_parent()) {
    kill(-pid, SIGCONT);
    return;
  }
  reclaim_tty();
  kill(getpid(), SIGSTOP);
  /* continued (fg, bg, kill -CONT) */
  if (fd >= 0 && tcgetpgrp(fd) == getpgrp()) {
    give_tty(fd, pid);
    tty_fd = fd;
    tty_pgrp = pid;
  }
  kill(-pid, SIGCONT);
}

/*
 * proc.wait(pid, timeout[, signal]) -> "exit", code | "signal", name, signo
 * | false.
 * Returns as soon as the child has ended (and reaps it), a trapped signal
 * is pending (see proc.signals), or timeout seconds have passed (false).
 * timeout 0 only looks.  With signal (a name), what remains of the child's
 * group is sent that signal once the child has ended, before it is reaped
 * (so that its group id cannot be reused meanwhile).
 */
static int l_wait(lua_State *L) {
  pid_t pid = (pid_t)luaL_checkinteger(L, 1);
  double timeout = luaL_checknumber(L, 2);
  const char *last = luaL_optstring(L, 3, NULL);
  double deadline;
  int i, last_sig = 0;
  luaL_argcheck(L, pid > 0, 1, "positive pid expected");
  luaL_argcheck(L, timeout >= 0, 2, "non-negative number expected");
  if (last) {
    for (i = 0; signames[i].name; i++)
      if (strcmp(signames[i].name, last) == 0) last_sig = signames[i].sig;
    luaL_argcheck(L, last_sig != 0, 3, "unknown signal name");
  }
  deadline = monotonic() + timeout;
  for (;;) {
    int st = 0, ms;
    pid_t r;
    double left;
    struct pollfd pfd;
    siginfo_t si;
    drain_pipe();
    memset(&si, 0, sizeof si);
    /* look without reaping: the group is signalled while the zombie holds
     * its pid */
    if (waitid(P_PID, (id_t)pid, &si,
               WEXITED | WNOHANG | WNOWAIT | (tty_pgrp == pid ? WSTOPPED : 0)) != 0 &&
        errno != EINTR)
      return push_errno(L, "waitid", errno);
    if (si.si_pid == pid && si.si_code == CLD_STOPPED) {
      r = waitpid(pid, &st, WUNTRACED | WNOHANG);   /* consumes the stop */
      (void)r;
      follow_stop(pid);
      continue;
    }
    if (si.si_pid == pid) {
      if (last_sig) kill(-pid, last_sig);
      r = waitpid(pid, &st, 0);
      if (r < 0) return push_errno(L, "waitpid", errno);
      if (tty_pgrp == pid) reclaim_tty();
      if (WIFEXITED(st)) {
        lua_pushliteral(L, "exit");
        lua_pushinteger(L, WEXITSTATUS(st));
        return 2;
      } else {
        const char *name = signame(WTERMSIG(st));
        lua_pushliteral(L, "signal");
        if (name) lua_pushstring(L, name);
        else lua_pushinteger(L, WTERMSIG(st));
        lua_pushinteger(L, WTERMSIG(st));
        return 3;
      }
    }
    if (any_caught()) break;
    left = deadline - monotonic();
    if (left <= 0) break;
    /* without proc.trap (or after proc.untrap) there is no SIGCHLD
     * wake-up: look every 50 ms */
    ms = left > 3600 ? 3600000 : (int)(left * 1000) + 1;
    if (!trapping && ms > 50) ms = 50;
    /* a stop makes no SIGCHLD (SA_NOCLDSTOP): look every 100 ms */
    if (tty_fd >= 0 && ms > 100) ms = 100;
    pfd.fd = wake_pipe[0];
    pfd.events = POLLIN;
    pfd.revents = 0;
    if (poll(&pfd, wake_pipe[0] < 0 ? 0 : 1, ms) < 0 && errno != EINTR)
      return push_errno(L, "poll", errno);
  }
  lua_pushboolean(L, 0);
  return 1;
}

/*
 * proc.wait_group(pid, timeout) -> true | false, after proc.wait has reaped
 * the child pid: true once the process group it led is empty (no process
 * has that group id), false when a trapped signal is pending or timeout
 * seconds have passed.  The kernel keeps a group's id from being reused
 * while any process is in the group.  Members that became this process's
 * children (it is their subreaper) are reaped here, as a zombie still
 * counts as a member.
 */
static int l_wait_group(lua_State *L) {
  pid_t pid = (pid_t)luaL_checkinteger(L, 1);
  double timeout = luaL_checknumber(L, 2), deadline;
  luaL_argcheck(L, pid > 1, 1, "pid of a spawned child expected");
  luaL_argcheck(L, timeout >= 0, 2, "non-negative number expected");
  deadline = monotonic() + timeout;
  for (;;) {
    int st, ms;
    double left;
    struct pollfd pfd;
    drain_pipe();
    while (waitpid(-pid, &st, WNOHANG) > 0) {}
    if (kill(-pid, 0) != 0 && errno == ESRCH) {
      lua_pushboolean(L, 1);
      return 1;
    }
    if (any_caught()) break;
    left = deadline - monotonic();
    if (left <= 0) break;
    /* a member's exit wakes nothing here (it is not a child): look every
     * 50 ms */
    ms = left > 0.05 ? 50 : (int)(left * 1000) + 1;
    pfd.fd = wake_pipe[0];
    pfd.events = POLLIN;
    pfd.revents = 0;
    if (poll(&pfd, wake_pipe[0] < 0 ? 0 : 1, ms) < 0 && errno != EINTR)
      return push_errno(L, "poll", errno);
  }
  lua_pushboolean(L, 0);
  return 1;
}

/* proc.kill(pid, name) -> true | nil, message, errno: signals the process
 * group that pid leads (every process spawn's child started in it) */
static int l_kill(lua_State *L) {
  pid_t pid = (pid_t)luaL_checkinteger(L, 1);
  const char *name = luaL_checkstring(L, 2);
  int i, sig = 0;
  luaL_argcheck(L, pid > 1, 1, "pid of a spawned child expected");
  for (i = 0; signames[i].name; i++)
    if (strcmp(signames[i].name, name) == 0) sig = signames[i].sig;
  luaL_argcheck(L, sig != 0, 2, "unknown signal name");
  if (kill(-pid, sig) != 0) return push_errno(L, "kill", errno);
  lua_pushboolean(L, 1);
  return 1;
}

/* proc.subreaper(on) -> true | false (not Linux): this process becomes
 * (or stops being) the parent of what its children's processes leave
 * orphaned (see the invariants) */
static int l_subreaper(lua_State *L) {
  int on = lua_toboolean(L, 1);
#ifdef PR_SET_CHILD_SUBREAPER
  lua_pushboolean(L, prctl(PR_SET_CHILD_SUBREAPER, on ? 1 : 0, 0, 0, 0) == 0);
#else
  (void)on;
  lua_pushboolean(L, 0);
#endif
  return 1;
}

/*
 * proc.wait_input(timeout) -> "eof" | "data" | false | nil, for mongolock
 * hold: waits up to timeout seconds for stdin to end.  "eof": stdin (a
 * pipe, FIFO, socket, or a terminal whose foreground group this process
 * is) has ended; "data": input came, read and dropped; false: the time
 * passed or a trapped signal is pending; nil: stdin is not watched (a
 * file, /dev/null, closed, or a terminal this process is in the background
 * of, where a read would stop it).
 */
static int l_wait_input(lua_State *L) {
  double timeout = luaL_checknumber(L, 1);
  struct stat sb;
  struct pollfd pfd[2];
  char buf[4096];
  ssize_t n;
  luaL_argcheck(L, timeout >= 0, 1, "non-negative number expected");
  if (fstat(0, &sb) != 0 || !(S_ISFIFO(sb.st_mode) || S_ISSOCK(sb.st_mode) ||
                              (isatty(0) && tcgetpgrp(0) == getpgrp()))) {
    lua_pushnil(L);
    return 1;
  }
  drain_pipe();
  pfd[0].fd = 0;
  pfd[0].events = POLLIN;
  pfd[0].revents = 0;
  pfd[1].fd = wake_pipe[0];
  pfd[1].events = POLLIN;
  pfd[1].revents = 0;
  if (!any_caught() &&
      poll(pfd, wake_pipe[0] < 0 ? 1 : 2, timeout > 3600 ? 3600000 : (int)(timeout * 1000)) < 0 &&
      errno != EINTR)
    return push_errno(L, "poll", errno);
  if (!(pfd[0].revents & (POLLIN | POLLHUP | POLLERR))) {
    lua_pushboolean(L, 0);
    return 1;
  }
  n = read(0, buf, sizeof buf);
  if (n > 0) lua_pushliteral(L, "data");
  else if (n < 0 && (errno == EINTR || errno == EAGAIN)) lua_pushboolean(L, 0);
  else lua_pushliteral(L, "eof");          /* ended, or unreadable for good */
  return 1;
}

/* proc.isatty(fd) -> boolean: is descriptor fd a terminal? */
static int l_isatty(lua_State *L) {
  lua_pushboolean(L, isatty((int)luaL_checkinteger(L, 1)));
  return 1;
}

static const luaL_Reg proc_funcs[] = {
  {"trap", l_trap},
  {"untrap", l_untrap},
  {"signals", l_signals},
  {"spawn", l_spawn},
  {"subreaper", l_subreaper},
  {"wait", l_wait},
  {"kill", l_kill},
  {"wait_group", l_wait_group},
  {"wait_input", l_wait_input},
  {"isatty", l_isatty},
  {NULL, NULL}
};

__attribute__((visibility("default")))
int luaopen_mongolock_proc(lua_State *L);

int luaopen_mongolock_proc(lua_State *L) {
  luaL_newlib(L, proc_funcs);
  lua_pushliteral(L, "0.1.0");
  lua_setfield(L, -2, "_VERSION");
  return 1;
}
