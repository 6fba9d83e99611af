/* router._pump: the router's relay pump as a native thread (see router/relay.py).
 *
 * Why native. Relaying one SSE event costs the router a wake-up, a recv, a scan of the chunk-size
 * line and a write. In Python each of those wake-ups also costs a round of trio's scheduler and
 * the interpreter's own work, which measured at about twice the kernel's share. This thread does
 * the same job without the interpreter: it never takes the GIL, never calls into Python, and
 * touches nothing but the descriptors handed to it and its own job table.
 *
 * Contract with router/relay.py (NativeRelayPump):
 *  - add(up_fd, client_fd, state, remaining, line) hands over the rest of one chunked body. The
 *    job is keyed by up_fd: the engine socket, which the caller keeps open until the job ends.
 *  - respond(up_fd, client_fd, suffix) hands over a whole response, from the engine's head on:
 *    an HTTP/1.1 200 head with a chunked body is rewritten for the client (client_head, with
 *    the router's suffix) and sent with the body bytes that came with it, and the job goes on as
 *    add's; any other head, or one whose body bytes that came along are malformed, ends the
 *    job with HEAD and the bytes read, nothing sent; an engine
 *    that fails before its head is complete ends it with EARLY (errno, whether bytes came).
 *  - withdraw(up_fd) takes a job back (its task was cancelled) and returns when the job's
 *    response head went out (0.0: it had not). A job that had already ended has its result
 *    queued and not yet collected: withdraw takes it out of the queue (so a reused descriptor
 *    never sees a stale one) and returns it too, since what the job did stands (a response
 *    sent whole is not undone by the client leaving just after).
 *  - collect() returns the jobs that ended, as (up_fd, code, extra, message, data, errno,
 *    sent_at), sent_at being when a response job's head went out; the thread signals
 *    an eventfd (notify_fd) when the queue turns non-empty (or, early, when a body's last bytes
 *    are about to be sent), which trio waits on.
 *  - Every result (and withdraw, for a running job) carries the job's facts (facts_t, observe):
 *    its events, when the first and last came, its gap histogram over Pump(gap_bounds=...)'s
 *    bounds, and with want_tail its body's last bytes: what /metrics needs per response, gathered
 *    where the thread handles each event anyway, so the router runs no Python per event.
 *  - close() stops the thread and returns the up_fds of the jobs still running.
 *  - Pump(coalesce_us) bounds the pause after each wake-up, which adapts below it (see serve).
 *  - scan_chunked(state, remaining, line, data) runs scan() alone, for the differential test.
 * One mutex guards everything shared; the thread holds it while it serves one epoll event and
 * never blocks while holding it (every socket call is non-blocking). Jobs live in a
 * table indexed by up_fd, and epoll events carry the up_fd rather than a pointer, so an event for
 * a job that was withdrawn meanwhile finds an empty slot (or, with the descriptor reused, a job
 * for which the event is spurious: a recv or send that would block, which is handled).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* The limits and scanner states shared with the Python pump: generated from router/pumpconst.py. */
#include "_pump_const.h"

#define MAX_EVENTS 256
#define CLIENT_BIT ((uint64_t)1 << 32)
#define STOP_TOKEN ((uint64_t)1 << 40)
/* A wake-up that served one event after waiting longer than this many pauses finds the pump idle. */
#define IDLE_PAUSES 4
/* The pause grows with the streams being relayed: none for one stream, the whole coalesce_ns
 * from 1 + FULL_PAUSE_OTHERS streams on (see serve). */
#define FULL_PAUSE_OTHERS 8

/* Result codes, as relay.py reads them. HEAD: the engine's response head was not one this thread
 * relays itself, and what arrived is handed back to the router. EARLY: the engine failed before its
 * head was complete (nothing reached the client, so the router may try another replica). */
enum { R_DONE = 0, R_ENGINE = 1, R_CLIENT = 2, R_HEAD = 3, R_EARLY = 4 };

/* Per-event facts for /metrics (see observe): at most MAX_GAP_BOUNDS gap histogram bounds, and
 * the body's last TAIL_BYTES bytes for the router to read usage from (_pump_const.h). */

/* What a job learned about its body as it relayed it, handed to the router once, with the job's
 * result (or by withdraw): the router folds it into its per-model histograms then, so no Python
 * runs per event. An event is a chunk (engines write one SSE event per chunk); its time is that of
 * the read that brought its size line, so events read together are 0 s apart. */
typedef struct {
    uint64_t events;              /* chunks begun: their size lines read */
    double first_at, last_at;     /* CLOCK_MONOTONIC seconds of the reads with the first and last */
    double gap_sum;               /* the gaps between consecutive events, summed ... */
    uint32_t gaps[MAX_GAP_BOUNDS + 1]; /* ... and counted per bucket (value <= bound; the last: above all) */
    int want_tail;
    char *tail; /* want_tail: the body's last TAIL_BYTES bytes (malloc'd on first use) */
    size_t tail_len;
} facts_t;

typedef struct {
    int up_fd, client_fd;
    int state;
    uint64_t remaining;
    char line[MAX_CHUNK_LINE + 1];
    size_t line_len;
    char *pending; /* bytes the client's socket did not take yet */
    size_t pending_len;
    int extra;       /* the connection cannot carry another request: bytes past the body's end,
                        or the engine said connection: close */
    int on_client;   /* waiting for the client's socket to drain rather than for the engine */
    int in_head;     /* a response job that has not relayed its head yet (see client_head) */
    int fresh;       /* no body byte relayed yet: also watched by urgent_fd, so no pause delays it */
    char *head;      /* ... what the engine sent so far */
    size_t head_len;
    char *suffix;    /* ... the router's own headers and the blank line, appended to the head */
    size_t suffix_len;
    double sent_at;  /* CLOCK_MONOTONIC seconds when the head went to the client (response jobs) */
    facts_t facts;
} job_t;

typedef struct {
    int up_fd, code, extra, err;
    char message[160];
    char *data; /* R_HEAD: what the engine sent (owned; handed to Python by collect) */
    size_t data_len;
    double sent_at;
    facts_t facts; /* the job's (its tail owned here now) */
} result_t;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_t thread;
    int thread_started;
    int epfd, notify_fd, stop_fd;
    int urgent_fd; /* an epoll set of the fresh jobs' engine sockets: what ends a pause early */
    job_t **jobs; /* indexed by up_fd */
    size_t jobs_cap;
    size_t streams, blocked;
    result_t *results;
    size_t results_len, results_cap;
    int closed;
    int signalled; /* the eventfd was written since collect() last took the results */
    long coalesce_ns; /* after a wake-up, wait at most this long before looking again (see serve) */
    unsigned long long wakeups, pauses, reads; /* for /metrics: reads per wake-up is what coalescing buys */
    double bounds[MAX_GAP_BOUNDS]; /* the gap histogram's bucket bounds, in seconds, ascending */
    int nbounds;
} Pump;

/* ---- the chunked-body scanner ------------------------------------------------------------- */

/* Chunked framing, the rules of router/framing.py (ChunkedScanner) and no others; the two are
 * held to the same results by tests/test_framing_differential.py (run through scan_chunked):
 *   chunk-line   = 1*15HEXDIG *( BWS ";" BWS token [ BWS "=" BWS ( token / quoted-string ) ] ) OWS CRLF
 *   after a chunk's data: exactly CRLF
 *   trailer-line = token ":" *( any byte but CR, LF, NUL ) CRLF, the section ended by an empty line
 * Every line ends in CRLF (a bare LF is malformed) and is at most MAX_CHUNK_LINE bytes before its LF. */

static int is_ws(char c) { return c == ' ' || c == '\t'; }

static int is_tchar(unsigned char c) {
    if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return 1;
    return c && strchr("!#$%&'*+-.^_`|~", c) != NULL;
}

static size_t skip_ws(const char *s, size_t i, size_t n) {
    while (i < n && is_ws(s[i])) i++;
    return i;
}

static size_t skip_token(const char *s, size_t i, size_t n) {
    while (i < n && is_tchar((unsigned char)s[i])) i++;
    return i;
}

/* A quoted-string from s[i] (a DQUOTE): the index after its closing DQUOTE, or 0 if malformed. */
static size_t skip_quoted(const char *s, size_t i, size_t n) {
    for (i++; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"') return i + 1;
        if (c == '\\') {
            if (++i >= n) return 0;
            c = (unsigned char)s[i];
            if (!(c == '\t' || (c >= 0x20 && c != 0x7f))) return 0;
        } else if (!(c == '\t' || (c >= 0x20 && c != 0x7f))) {
            return 0;
        }
    }
    return 0;
}

/* Parses a chunk line s[0..n) (the bytes before its LF, its CR last). Returns 0 and sets *size,
 * or -1. */
static int parse_size(const char *s, size_t n, uint64_t *size) {
    if (!n || s[n - 1] != '\r') return -1;
    n--; /* the CR */
    size_t i = 0;
    uint64_t v = 0;
    for (; i < n; i++) {
        char c = s[i];
        int d;
        if (c >= '0' && c <= '9') d = c - '0';
        else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
        else break;
        if (i >= MAX_SIZE_DIGITS) return -1;
        v = v * 16 + (uint64_t)d;
    }
    if (!i) return -1;
    for (;;) { /* extensions, then the optional whitespace before the CR */
        i = skip_ws(s, i, n);
        if (i == n) break;
        if (s[i] != ';') return -1;
        i = skip_ws(s, i + 1, n);
        size_t e = skip_token(s, i, n);
        if (e == i) return -1;
        i = e;
        size_t k = skip_ws(s, i, n);
        if (k < n && s[k] == '=') {
            i = skip_ws(s, k + 1, n);
            if (i < n && s[i] == '"') {
                e = skip_quoted(s, i, n);
                if (!e) return -1;
            } else {
                e = skip_token(s, i, n);
                if (e == i) return -1;
            }
            i = e;
        }
    }
    *size = v;
    return 0;
}

/* A trailer line s[0..n) (before its LF): a token, a colon, a value without CR or NUL, the CR. */
static int good_trailer(const char *s, size_t n) {
    if (!n || s[n - 1] != '\r') return 0;
    n--;
    size_t i = skip_token(s, 0, n);
    if (!i || i == n || s[i] != ':') return 0;
    for (i++; i < n; i++)
        if (s[i] == '\r' || s[i] == 0) return 0;
    return 1;
}

static void bad_line(char *err, size_t cap, const char *what, const char *s, size_t n) {
    char shown[44];
    size_t k = n < 40 ? n : 40;
    for (size_t i = 0; i < k; i++) shown[i] = (s[i] >= 32 && s[i] < 127) ? s[i] : '?';
    shown[k] = 0;
    snprintf(err, cap, "%s '%s'", what, shown);
}

/* How many bytes of data belong to the body; -1 with err set on a malformed chunk. */
static ssize_t scan(job_t *j, const char *data, size_t n, char *err, size_t cap) {
    size_t i = 0;
    while (i < n) {
        if (j->state == S_DATA) {
            size_t take = n - i;
            if (take > j->remaining) take = (size_t)j->remaining;
            i += take;
            j->remaining -= take;
            if (!j->remaining) {
                j->state = S_CRLF;
                j->remaining = 2;
            }
            continue;
        }
        if (j->state == S_CRLF) { /* remaining 2: the CR is next, 1: the LF */
            if (data[i] != (j->remaining == 2 ? '\r' : '\n')) {
                bad_line(err, cap, "chunk data not followed by CRLF:", data + i, 1);
                return -1;
            }
            i++;
            if (!--j->remaining) j->state = S_SIZE;
            continue;
        }
        if (j->state == S_DONE) return (ssize_t)i;
        /* S_SIZE or S_TRAILER: a line */
        const char *nl = memchr(data + i, '\n', n - i);
        const char *line;
        size_t len;
        if (!nl) {
            if (j->line_len + (n - i) > MAX_CHUNK_LINE) {
                snprintf(err, cap, "chunk line over %d bytes", MAX_CHUNK_LINE);
                return -1;
            }
            memcpy(j->line + j->line_len, data + i, n - i);
            j->line_len += n - i;
            return (ssize_t)n;
        }
        size_t part = (size_t)(nl - (data + i));
        if (j->line_len + part > MAX_CHUNK_LINE) {
            snprintf(err, cap, "chunk line over %d bytes", MAX_CHUNK_LINE);
            return -1;
        }
        if (j->line_len) {
            memcpy(j->line + j->line_len, data + i, part);
            line = j->line;
            len = j->line_len + part;
            j->line_len = 0;
        } else {
            line = data + i;
            len = part;
        }
        i += part + 1;
        if (j->state == S_SIZE) {
            uint64_t size;
            if (parse_size(line, len, &size) < 0) {
                bad_line(err, cap, "bad chunk size line", line, len);
                return -1;
            }
            if (size) {
                j->state = S_DATA;
                j->remaining = size;
                j->facts.events++;
            } else {
                j->state = S_TRAILER;
            }
        } else if (len == 1 && line[0] == '\r') { /* the empty line after the (usually absent) trailers */
            j->state = S_DONE;
            return (ssize_t)i;
        } else if (!good_trailer(line, len)) {
            bad_line(err, cap, "bad trailer line", line, len);
            return -1;
        }
    }
    return (ssize_t)i;
}

/* ---- the thread (runs without the GIL, with p->mu held while serving events) -------------- */

static result_t *push_result(Pump *p, int up_fd, int code, int extra, const char *message) {
    if (p->results_len == p->results_cap) {
        size_t cap = p->results_cap ? p->results_cap * 2 : 64;
        result_t *r = realloc(p->results, cap * sizeof(result_t));
        if (!r) abort(); /* out of memory in a thread that cannot raise */
        p->results = r;
        p->results_cap = cap;
    }
    result_t *r = &p->results[p->results_len++];
    r->up_fd = up_fd;
    r->code = code;
    r->extra = extra;
    r->err = 0;
    r->data = NULL;
    r->data_len = 0;
    r->sent_at = 0;
    memset(&r->facts, 0, sizeof r->facts);
    snprintf(r->message, sizeof r->message, "%s", message);
    return r;
}

static void unwatch(Pump *p, job_t *j) {
    epoll_ctl(p->epfd, EPOLL_CTL_DEL, j->on_client ? j->client_fd : j->up_fd, NULL);
    if (j->on_client) p->blocked--;
}

/* The job has relayed its first body bytes (or waits on its client): pauses may delay it now. */
static void settled(Pump *p, job_t *j) {
    if (!j->fresh) return;
    epoll_ctl(p->urgent_fd, EPOLL_CTL_DEL, j->up_fd, NULL);
    j->fresh = 0;
}

static void drop(Pump *p, job_t *j) {
    settled(p, j);
    unwatch(p, j);
    p->jobs[j->up_fd] = NULL;
    p->streams--;
    free(j->pending);
    free(j->head);
    free(j->suffix);
    free(j->facts.tail);
    free(j);
}

static void finish(Pump *p, job_t *j, int code, const char *message) {
    result_t *r = push_result(p, j->up_fd, code, j->extra, message);
    r->sent_at = j->sent_at;
    r->facts = j->facts; /* the tail moves to the result */
    j->facts.tail = NULL;
    drop(p, j);
}

/* strerror is not safe beside Python's own calls to it; the GNU strerror_r is (Python.h asks
 * for _GNU_SOURCE). */
static void finish_errno(Pump *p, job_t *j, int code, int e) {
    char buf[120];
    finish(p, j, code, strerror_r(e, buf, sizeof buf));
}

static int watch_client(Pump *p, job_t *j) {
    struct epoll_event ev = {.events = EPOLLOUT, .data.u64 = (uint64_t)j->up_fd | CLIENT_BIT};
    settled(p, j); /* not readable-watched now: its engine's bytes must not end pauses */
    epoll_ctl(p->epfd, EPOLL_CTL_DEL, j->up_fd, NULL);
    if (epoll_ctl(p->epfd, EPOLL_CTL_ADD, j->client_fd, &ev) < 0) return -1;
    j->on_client = 1;
    p->blocked++;
    return 0;
}

static int watch_up(Pump *p, job_t *j) {
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = (uint64_t)j->up_fd};
    epoll_ctl(p->epfd, EPOLL_CTL_DEL, j->client_fd, NULL);
    j->on_client = 0;
    p->blocked--;
    return epoll_ctl(p->epfd, EPOLL_CTL_ADD, j->up_fd, &ev);
}

/* Writes data to the client; keeps what it did not take. Returns 1 if the job ended. */
static int send_client(Pump *p, job_t *j, const char *data, size_t n) {
    size_t sent = 0;
    while (sent < n) {
        ssize_t w = send(j->client_fd, data + sent, n - sent, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (w > 0) {
            sent += (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        if (w < 0) finish_errno(p, j, R_CLIENT, errno);
        else finish(p, j, R_CLIENT, "the client's socket took nothing");
        return 1;
    }
    if (sent < n) { /* the client's socket is full: stop reading the engine until it drains */
        char *rest = malloc(n - sent);
        if (!rest) abort();
        memcpy(rest, data + sent, n - sent);
        j->pending = rest;
        j->pending_len = n - sent;
        if (!j->on_client && watch_client(p, j) < 0) {
            finish_errno(p, j, R_CLIENT, errno);
            return 1;
        }
        return 0;
    }
    if (j->state == S_DONE) {
        finish(p, j, R_DONE, "");
        return 1;
    }
    return 0;
}

static void notify(Pump *p) {
    uint64_t one = 1;
    ssize_t w = write(p->notify_fd, &one, sizeof one);
    (void)w;
    p->signalled = 1;
}

static double monotonic_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* The gap histogram's bucket for a gap of g seconds: the first bound at or above it. */
static int gap_bucket(const Pump *p, double g) {
    int i = 0;
    while (i < p->nbounds && g > p->bounds[i]) i++;
    return i;
}

/* The per-event facts of one read: body bytes data[0..n) (those scan took), which began the
 * events since `before`. One clock read per read that began an event, nothing per byte; the
 * tail is copied only for a job that asked for it (a response whose usage the router reads). */
static void observe(Pump *p, job_t *j, uint64_t before, const char *data, size_t n, double now) {
    facts_t *f = &j->facts;
    uint64_t fresh = f->events - before;
    if (fresh) {
        if (now == 0) now = monotonic_now();
        if (f->last_at != 0) { /* an event before this read: the gap from it */
            double g = now - f->last_at;
            f->gaps[gap_bucket(p, g)]++;
            f->gap_sum += g;
        } else {
            f->first_at = now;
        }
        if (fresh > 1) f->gaps[gap_bucket(p, 0.0)] += (uint32_t)(fresh - 1); /* read together: 0 s */
        f->last_at = now;
    }
    if (f->want_tail && n) {
        if (!f->tail) {
            f->tail = malloc(TAIL_BYTES);
            if (!f->tail) abort();
        }
        if (n >= TAIL_BYTES) {
            memcpy(f->tail, data + n - TAIL_BYTES, TAIL_BYTES);
            f->tail_len = TAIL_BYTES;
        } else {
            if (f->tail_len + n > TAIL_BYTES) {
                size_t keep = TAIL_BYTES - n;
                memmove(f->tail, f->tail + f->tail_len - keep, keep);
                f->tail_len = keep;
            }
            memcpy(f->tail + f->tail_len, data, n);
            f->tail_len += n;
        }
    }
}

/* One read from the engine (EINTR retried, reads counted); errno is the read's on -1. */
static ssize_t receive_up(Pump *p, job_t *j, char *buf) {
    ssize_t r;
    do {
        r = recv(j->up_fd, buf, RECEIVE_SIZE, MSG_DONTWAIT);
    } while (r < 0 && errno == EINTR);
    if (r > 0) p->reads++;
    return r;
}

static void readable(Pump *p, job_t *j, char *buf) {
    ssize_t r = receive_up(p, j, buf);
    if (r < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        finish_errno(p, j, R_ENGINE, errno);
        return;
    }
    if (r == 0) {
        finish(p, j, R_ENGINE, "the engine closed the connection mid-response");
        return;
    }
    char err[120];
    uint64_t before = j->facts.events;
    ssize_t used = scan(j, buf, (size_t)r, err, sizeof err);
    if (used < 0) {
        finish(p, j, R_ENGINE, err);
        return;
    }
    if (used < r) j->extra = 1;
    observe(p, j, before, buf, (size_t)used, 0);
    settled(p, j);
    if (j->state == S_DONE) {
        /* The body ends with this send: wake trio now, so its wake-up overlaps the send and the
         * client's turn-around rather than following them (at low load, the response's task
         * finishing late is what the client's next request on this connection waits for). If
         * the send is partial the wake-up finds nothing yet, which is harmless. */
        notify(p);
    }
    send_client(p, j, buf, (size_t)used);
}

/* ---- response heads ------------------------------------------------------------------------ */

static int is_space(char c) { return c == ' ' || c == '\t' || c == '\v' || c == '\f'; }

/* Lowercase ASCII comparison of s[0..n) with the lowercase word w. */
static int same_word(const char *s, size_t n, const char *w) {
    size_t k = strlen(w);
    if (n != k) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (c >= 'A' && c <= 'Z') c = (char)(c - 'A' + 'a');
        if (c != w[i]) return 0;
    }
    return 1;
}

static const char *const HOP_BY_HOP[] = {
    "connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
    "te", "trailer", "transfer-encoding", "upgrade", "content-length", NULL,
};

/* The client's response head for the engine's head h[0..n) (status line and header lines, without
 * the blank line), in the one case this thread relays itself: HTTP/1.1 200 with a chunked body and
 * plain header lines. It is what router.server writes for such a head: the status line with the
 * engine's reason, the engine's headers (names lowercased, values stripped) less the hop-by-hop
 * ones, then the router's suffix. Returns a malloc'd buffer and sets *out_len and *keep (the
 * engine keeps the connection open), or returns NULL for any other head, which then goes to the
 * router's Python (router.parse_response_head), the one place that judges and refuses heads;
 * tests/test_relay.py checks that the two agree. */
static char *client_head(const char *h, size_t n, const char *suffix, size_t suffix_len, size_t *out_len,
                         int *keep) {
    for (size_t i = 0; i < n; i++) {
        char c = h[i];
        if (c == 0) return NULL;
        if (c == '\r' && (i + 1 >= n || h[i + 1] != '\n')) return NULL;
        if (c == '\n' && (i == 0 || h[i - 1] != '\r')) return NULL;
    }
    const char *eol = memmem(h, n, "\r\n", 2);
    size_t status_len = eol ? (size_t)(eol - h) : n;
    static const char status[] = "HTTP/1.1 200";
    size_t sl = sizeof status - 1;
    if (status_len < sl || memcmp(h, status, sl) != 0 || (status_len > sl && h[sl] != ' ')) return NULL;
    const char *reason = status_len > sl ? h + sl + 1 : "";
    size_t reason_len = status_len > sl ? status_len - sl - 1 : 0;
    if (!reason_len) {
        reason = "OK";
        reason_len = 2;
    }
    char *out = malloc(2 * n + 32 + suffix_len); /* "a:b" lines grow by one byte each */
    if (!out) abort();
    size_t o = 0;
    memcpy(out, "HTTP/1.1 200 ", 13);
    o = 13;
    memcpy(out + o, reason, reason_len);
    o += reason_len;
    out[o++] = '\r';
    out[o++] = '\n';
    int chunked = 0, close = 0;
    size_t i = eol ? status_len + 2 : n;
    while (i < n) {
        const char *line = h + i;
        const char *next = memmem(line, n - i, "\r\n", 2);
        size_t len = next ? (size_t)(next - line) : n - i;
        i += len + 2;
        const char *colon = memchr(line, ':', len);
        if (!colon || !len || is_space(line[0])) goto other; /* malformed, or a continuation line */
        size_t a = 0, b = (size_t)(colon - line);
        while (a < b && is_space(line[a])) a++;
        while (b > a && is_space(line[b - 1])) b--;
        size_t va = (size_t)(colon - line) + 1, vb = len;
        while (va < vb && is_space(line[va])) va++;
        while (vb > va && is_space(line[vb - 1])) vb--;
        const char *name = line + a, *value = line + va;
        size_t name_len = b - a, value_len = vb - va;
        if (same_word(name, name_len, "content-length")) goto other;
        if (same_word(name, name_len, "transfer-encoding"))
            chunked = value_len >= 7 && same_word(value + value_len - 7, 7, "chunked");
        if (same_word(name, name_len, "connection")) {
            int saw_close = 0, saw_keep = 0;
            size_t t = 0;
            while (t <= value_len) {
                size_t e = t;
                while (e < value_len && value[e] != ',') e++;
                size_t ta = t, tb = e;
                while (ta < tb && is_space(value[ta])) ta++;
                while (tb > ta && is_space(value[tb - 1])) tb--;
                if (same_word(value + ta, tb - ta, "close")) saw_close = 1;
                if (same_word(value + ta, tb - ta, "keep-alive")) saw_keep = 1;
                t = e + 1;
            }
            if (saw_close) close = 1;
            else if (saw_keep) close = 0;
        }
        int hop = 0;
        for (const char *const *w = HOP_BY_HOP; *w; w++)
            if (same_word(name, name_len, *w)) hop = 1;
        if (hop) continue;
        for (size_t k = 0; k < name_len; k++) {
            char c = name[k];
            out[o++] = (c >= 'A' && c <= 'Z') ? (char)(c - 'A' + 'a') : c;
        }
        out[o++] = ':';
        out[o++] = ' ';
        memcpy(out + o, value, value_len);
        o += value_len;
        out[o++] = '\r';
        out[o++] = '\n';
    }
    if (!chunked) goto other;
    memcpy(out + o, suffix, suffix_len);
    *out_len = o + suffix_len;
    *keep = !close;
    return out;
other:
    free(out);
    return NULL;
}

/* Give the engine's head, as received, back to the router (R_HEAD), which answers for it. */
static void hand_head_back(Pump *p, job_t *j) {
    result_t *res = push_result(p, j->up_fd, R_HEAD, 0, "");
    res->data = j->head;
    res->data_len = j->head_len;
    j->head = NULL;
    drop(p, j);
}

/* A response job's head phase: collect the engine's head; relay it if client_head takes it, with
 * the body bytes that came along, and go on as a body job; otherwise hand it to the router. */
static void head_readable(Pump *p, job_t *j, char *buf) {
    ssize_t r = receive_up(p, j, buf);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (r <= 0) {
        int e = r < 0 ? errno : 0;
        char text[120] = "";
        const char *message = e ? strerror_r(e, text, sizeof text)
                              : j->head_len ? "closed mid response head"
                                            : "closed the connection before responding";
        result_t *res = push_result(p, j->up_fd, R_EARLY, j->head_len > 0, message);
        res->err = e;
        drop(p, j);
        return;
    }
    char *h = realloc(j->head, j->head_len + (size_t)r);
    if (!h) abort();
    memcpy(h + j->head_len, buf, (size_t)r);
    size_t from = j->head_len > 3 ? j->head_len - 3 : 0;
    j->head = h;
    j->head_len += (size_t)r;
    const char *end = memmem(h + from, j->head_len - from, "\r\n\r\n", 4);
    size_t out_len = 0;
    int keep = 0;
    char *out = end ? client_head(h, (size_t)(end - h), j->suffix, j->suffix_len, &out_len, &keep) : NULL;
    if (!out) {
        if (!end && j->head_len <= MAX_HEAD_BYTES) return; /* more to come */
        hand_head_back(p, j);
        return;
    }
    const char *body = end + 4;
    size_t body_len = j->head_len - (size_t)(body - h);
    char err[120];
    ssize_t used = body_len ? scan(j, body, body_len, err, sizeof err) : 0;
    if (used < 0) { /* nothing sent yet: the router answers for a malformed body (a 502) */
        free(out);
        hand_head_back(p, j);
        return;
    }
    if ((size_t)used < body_len || !keep) j->extra = 1;
    if (used > 0) settled(p, j); /* the first event came with the head; otherwise still fresh */
    char *all = realloc(out, out_len + (size_t)used);
    if (!all) abort();
    memcpy(all + out_len, body, (size_t)used);
    j->sent_at = monotonic_now();
    observe(p, j, 0, body, (size_t)used, j->sent_at); /* body points into j->head: before it goes */
    free(j->head);
    free(j->suffix);
    j->head = j->suffix = NULL;
    j->head_len = j->suffix_len = 0;
    j->in_head = 0;
    if (j->state == S_DONE) notify(p); /* as in readable */
    send_client(p, j, all, out_len + (size_t)used);
    free(all);
}

static void writable(Pump *p, job_t *j) {
    char *data = j->pending;
    size_t n = j->pending_len;
    j->pending = NULL;
    j->pending_len = 0;
    if (!data) return; /* spurious */
    int ended = send_client(p, j, data, n);
    free(data);
    if (!ended && !j->pending && watch_up(p, j) < 0) finish_errno(p, j, R_ENGINE, errno);
}

static void *serve(void *arg) {
    Pump *p = arg;
    struct epoll_event evs[MAX_EVENTS];
    char *buf = malloc(RECEIVE_SIZE);
    if (!buf) abort();
    for (;;) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        int n = epoll_wait(p->epfd, evs, MAX_EVENTS, -1);
        if (n < 0) {
            if (errno == EINTR) continue;
            break;
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        long waited_ns = (t1.tv_sec - t0.tv_sec) * 1000000000L + (t1.tv_nsec - t0.tv_nsec);
        int stop = 0;
        /* The lock is taken per event, not per batch: the router's task adding a job waits for
         * one event's recv and send at most, not for a whole batch (hundreds of microseconds). */
        for (int k = 0; k < n; k++) {
            uint64_t d = evs[k].data.u64;
            if (d == STOP_TOKEN) {
                stop = 1;
                continue;
            }
            int fd = (int)(d & 0xffffffffu);
            pthread_mutex_lock(&p->mu);
            job_t *j = (size_t)fd < p->jobs_cap ? p->jobs[fd] : NULL;
            /* Skipped: withdrawn after epoll_wait returned, or stale (the job changed sides). */
            if (j && ((d & CLIENT_BIT) != 0) == (j->on_client != 0)) {
                if (j->on_client) writable(p, j);
                else if (j->in_head) head_readable(p, j, buf);
                else readable(p, j, buf);
            }
            pthread_mutex_unlock(&p->mu);
        }
        pthread_mutex_lock(&p->mu);
        p->wakeups++;
        /* One wake-up of trio for the results of this batch, unless one is on its way. */
        if (p->results_len > 0 && !p->signalled) notify(p);
        pthread_mutex_unlock(&p->mu);
        if (stop) break;
        /* Coalescing. Engines emit in steps: one decode step writes a token to every stream in
         * the batch within a fraction of a millisecond, and a thread that goes back to epoll_wait
         * at once is woken for nearly every one of them (each wake-up a context switch, about as
         * costly as the recv and send it serves). Pausing briefly lets the rest of the step
         * arrive, to be served by one wake-up. A token may wait up to the pause; the gaps between
         * a stream's tokens stay the same on average. An idle stream's next event is not delayed
         * at all: the pause has ended long before it comes. A full batch skips the pause. So does
         * a lone event after a long wait (more than IDLE_PAUSES pauses): the pump is idle,
         * nothing else is on its way, and the pause would only cost a second sleep and wake-up
         * per event (at concurrency 1 that was 68 us per event instead of 56).
         *
         * The pause adapts, so that one setting serves a lone stream and a busy router:
         *  - its length grows with the streams being relayed: none at one stream (there is no
         *    other stream's event to wait for, only this one's to delay), coalesce_ns from
         *    1 + FULL_PAUSE_OTHERS streams on; coalesce_ns is the upper bound;
         *  - a response's first event never waits it out: the engine sockets of jobs that have
         *    relayed no body byte yet (fresh) are also in urgent_fd, and the pause is a ppoll on
         *    that set, which ends as soon as one of them is readable. A response head or first
         *    token that arrives during a pause goes out at once, which is what the client's time
         *    to first byte is made of; the steady stream of later tokens is what coalesces. */
        pthread_mutex_lock(&p->mu);
        size_t streams = p->streams;
        pthread_mutex_unlock(&p->mu);
        long pause_ns = 0;
        if (streams > 1) {
            size_t others = streams - 1 < FULL_PAUSE_OTHERS ? streams - 1 : FULL_PAUSE_OTHERS;
            pause_ns = (long)(p->coalesce_ns * (long)others / FULL_PAUSE_OTHERS);
        }
        if (pause_ns && n < MAX_EVENTS && (n > 1 || waited_ns < IDLE_PAUSES * pause_ns)) {
            struct timespec ts = {0, pause_ns};
            struct pollfd urgent = {.fd = p->urgent_fd, .events = POLLIN};
            pthread_mutex_lock(&p->mu);
            p->pauses++;
            pthread_mutex_unlock(&p->mu);
            while (ppoll(&urgent, 1, &ts, NULL) < 0 && errno == EINTR) {
            }
        }
    }
    free(buf);
    return NULL;
}

/* ---- the Python type ------------------------------------------------------------------------ */

/* Takes p->mu from a Python call. The thread holds it while it serves one event, so wait for it
 * without the GIL when it is taken, rather than stall every other Python thread. */
static void lock_from_python(Pump *p) {
    if (pthread_mutex_trylock(&p->mu) == 0) return;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&p->mu);
    Py_END_ALLOW_THREADS
}

static PyObject *Pump_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"coalesce_us", "gap_bounds", NULL};
    long coalesce_us = 0;
    PyObject *gap_bounds = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|lO", kwlist, &coalesce_us, &gap_bounds)) return NULL;
    if (coalesce_us < 0 || coalesce_us > MAX_COALESCE_US) {
        PyErr_Format(PyExc_ValueError, "coalesce_us must be 0 to %d, got %ld", MAX_COALESCE_US, coalesce_us);
        return NULL;
    }
    double bounds[MAX_GAP_BOUNDS];
    Py_ssize_t nbounds = 0;
    if (gap_bounds && gap_bounds != Py_None) {
        PyObject *seq = PySequence_Fast(gap_bounds, "gap_bounds must be a sequence of seconds");
        if (!seq) return NULL;
        nbounds = PySequence_Fast_GET_SIZE(seq);
        int bad = nbounds > MAX_GAP_BOUNDS;
        for (Py_ssize_t i = 0; !bad && i < nbounds; i++) {
            bounds[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
            if (bounds[i] == -1.0 && PyErr_Occurred()) {
                Py_DECREF(seq);
                return NULL;
            }
            bad = !(bounds[i] > 0) || (i && !(bounds[i] > bounds[i - 1]));
        }
        Py_DECREF(seq);
        if (bad) {
            PyErr_Format(PyExc_ValueError, "gap_bounds must be at most %d positive ascending seconds", MAX_GAP_BOUNDS);
            return NULL;
        }
    }
    Pump *p = (Pump *)type->tp_alloc(type, 0);
    if (!p) return NULL;
    p->coalesce_ns = coalesce_us * 1000;
    memcpy(p->bounds, bounds, (size_t)nbounds * sizeof(double));
    p->nbounds = (int)nbounds;
    p->epfd = p->notify_fd = p->stop_fd = p->urgent_fd = -1;
    pthread_mutex_init(&p->mu, NULL);
    p->epfd = epoll_create1(EPOLL_CLOEXEC);
    p->urgent_fd = epoll_create1(EPOLL_CLOEXEC);
    p->notify_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    p->stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (p->epfd < 0 || p->urgent_fd < 0 || p->notify_fd < 0 || p->stop_fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(p);
        return NULL;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = STOP_TOKEN};
    if (epoll_ctl(p->epfd, EPOLL_CTL_ADD, p->stop_fd, &ev) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(p);
        return NULL;
    }
    int rc = pthread_create(&p->thread, NULL, serve, p);
    if (rc) {
        errno = rc;
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(p);
        return NULL;
    }
    p->thread_started = 1;
    return (PyObject *)p;
}

/* Stops and joins the thread, frees the jobs; returns their up_fds (a new list) or NULL. */
static PyObject *stop_thread(Pump *p) {
    if (p->thread_started) {
        uint64_t one = 1;
        ssize_t w = write(p->stop_fd, &one, sizeof one);
        (void)w;
        Py_BEGIN_ALLOW_THREADS
        pthread_join(p->thread, NULL);
        Py_END_ALLOW_THREADS
        p->thread_started = 0;
    }
    PyObject *left = PyList_New(0);
    for (size_t fd = 0; fd < p->jobs_cap; fd++) {
        job_t *j = p->jobs[fd];
        if (!j) continue;
        if (left) {
            PyObject *o = PyLong_FromSize_t(fd);
            if (!o || PyList_Append(left, o) < 0) Py_CLEAR(left);
            Py_XDECREF(o);
        }
        drop(p, j);
    }
    p->closed = 1;
    return left;
}

static void Pump_dealloc(Pump *p) {
    PyObject *left = stop_thread(p);
    Py_XDECREF(left);
    if (PyErr_Occurred()) PyErr_Clear();
    if (p->epfd >= 0) close(p->epfd);
    if (p->urgent_fd >= 0) close(p->urgent_fd);
    if (p->notify_fd >= 0) close(p->notify_fd);
    if (p->stop_fd >= 0) close(p->stop_fd);
    free(p->jobs);
    for (size_t i = 0; i < p->results_len; i++) {
        free(p->results[i].data);
        free(p->results[i].facts.tail);
    }
    free(p->results);
    pthread_mutex_destroy(&p->mu);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

/* Registers a new job (and frees it on failure, with a Python exception set). */
static PyObject *start_job(Pump *p, job_t *j) {
    int up_fd = j->up_fd;
    lock_from_python(p);
    const char *problem = NULL;
    if (p->closed) problem = "closed";
    else if ((size_t)up_fd < p->jobs_cap && p->jobs[up_fd]) problem = "busy";
    if (!problem && (size_t)up_fd >= p->jobs_cap) {
        size_t cap = p->jobs_cap ? p->jobs_cap : 1024;
        while (cap <= (size_t)up_fd) cap *= 2;
        job_t **t = realloc(p->jobs, cap * sizeof(job_t *));
        if (!t) problem = "memory";
        else {
            memset(t + p->jobs_cap, 0, (cap - p->jobs_cap) * sizeof(job_t *));
            p->jobs = t;
            p->jobs_cap = cap;
        }
    }
    int err = 0;
    if (!problem) {
        struct epoll_event ev = {.events = EPOLLIN, .data.u64 = (uint64_t)up_fd};
        if (epoll_ctl(p->epfd, EPOLL_CTL_ADD, up_fd, &ev) < 0) {
            err = errno;
            problem = "epoll";
        } else {
            p->jobs[up_fd] = j;
            p->streams++;
            /* Fresh until its first body bytes (see serve's pause); without the second set it
             * is merely not hurried. */
            j->fresh = epoll_ctl(p->urgent_fd, EPOLL_CTL_ADD, up_fd, &ev) == 0;
        }
    }
    pthread_mutex_unlock(&p->mu);
    if (problem) {
        free(j->suffix);
        free(j);
        if (err) {
            errno = err;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        if (problem[0] == 'm') return PyErr_NoMemory();
        PyErr_Format(PyExc_RuntimeError, "relay pump: %s (up_fd %d)",
                     problem[0] == 'c' ? "closed" : "a job for this descriptor is running", up_fd);
        return NULL;
    }
    Py_RETURN_NONE;
}

static int check_fds(int up_fd, int client_fd) {
    if (up_fd < 0 || client_fd < 0 || up_fd == client_fd) {
        PyErr_Format(PyExc_ValueError, "bad descriptors: up %d, client %d", up_fd, client_fd);
        return -1;
    }
    return 0;
}

/* A job at a scanner state handed over from Python (a response the Python relay began, or the
   differential test's input), checked before it is trusted: a state up to last, a line only in the
   states that read one. NULL with the exception set. */
static job_t *scanner_job(int state, int last, unsigned long long remaining, const char *line,
                          Py_ssize_t line_len) {
    if (state < S_SIZE || state > last || line_len > MAX_CHUNK_LINE ||
        (line_len && state != S_SIZE && state != S_TRAILER)) {
        PyErr_Format(PyExc_ValueError, "bad scanner state %d (line of %zd bytes)", state, line_len);
        return NULL;
    }
    job_t *j = calloc(1, sizeof *j);
    if (!j) {
        PyErr_NoMemory();
        return NULL;
    }
    j->state = state;
    j->remaining = remaining;
    memcpy(j->line, line, (size_t)line_len);
    j->line_len = (size_t)line_len;
    return j;
}

static PyObject *Pump_add(Pump *p, PyObject *args) {
    int up_fd, client_fd, state, want_tail = 0;
    unsigned long long remaining;
    const char *line;
    Py_ssize_t line_len;
    double since = 0;
    if (!PyArg_ParseTuple(args, "iiiKy#|dp", &up_fd, &client_fd, &state, &remaining, &line, &line_len, &since,
                          &want_tail))
        return NULL;
    if (check_fds(up_fd, client_fd) < 0) return NULL;
    job_t *j = scanner_job(state, S_TRAILER, remaining, line, line_len);
    if (!j) return NULL;
    j->up_fd = up_fd;
    j->client_fd = client_fd;
    j->facts.last_at = since > 0 ? since : 0; /* the body's events before this job: gaps go on from it */
    j->facts.want_tail = want_tail;
    return start_job(p, j);
}

static PyObject *Pump_respond(Pump *p, PyObject *args) {
    int up_fd, client_fd, want_tail = 0;
    const char *suffix;
    Py_ssize_t suffix_len;
    if (!PyArg_ParseTuple(args, "iiy#|p", &up_fd, &client_fd, &suffix, &suffix_len, &want_tail)) return NULL;
    if (check_fds(up_fd, client_fd) < 0) return NULL;
    job_t *j = calloc(1, sizeof *j);
    if (!j) return PyErr_NoMemory();
    j->suffix = malloc((size_t)suffix_len + 1);
    if (!j->suffix) {
        free(j);
        return PyErr_NoMemory();
    }
    memcpy(j->suffix, suffix, (size_t)suffix_len);
    j->suffix_len = (size_t)suffix_len;
    j->up_fd = up_fd;
    j->client_fd = client_fd;
    j->state = S_SIZE;
    j->in_head = 1;
    j->facts.want_tail = want_tail;
    return start_job(p, j);
}

/* A job's facts as Python reads them: (events, first_at, last_at, gap_sum, per-bucket gap counts,
 * tail or None), or None when it saw no event and kept no tail. Steals nothing. */
static PyObject *facts_tuple(const Pump *p, const facts_t *f) {
    if (!f->events && !f->tail_len) Py_RETURN_NONE;
    PyObject *gaps = PyTuple_New(p->nbounds + 1);
    if (!gaps) return NULL;
    for (int i = 0; i <= p->nbounds; i++) {
        PyObject *n = PyLong_FromUnsignedLong(f->gaps[i]);
        if (!n) {
            Py_DECREF(gaps);
            return NULL;
        }
        PyTuple_SET_ITEM(gaps, i, n);
    }
    PyObject *tail = f->tail_len ? PyBytes_FromStringAndSize(f->tail, (Py_ssize_t)f->tail_len) : Py_NewRef(Py_None);
    if (!tail) {
        Py_DECREF(gaps);
        return NULL;
    }
    return Py_BuildValue("(KdddNN)", (unsigned long long)f->events, f->first_at, f->last_at, f->gap_sum, gaps, tail);
}

/* A result as collect() and withdraw() hand it to Python (steals nothing; r->data stays owned). */
static PyObject *result_tuple(const Pump *p, const result_t *r) {
    PyObject *data = r->data ? PyBytes_FromStringAndSize(r->data, (Py_ssize_t)r->data_len) : Py_NewRef(Py_None);
    if (!data) return NULL;
    PyObject *facts = facts_tuple(p, &r->facts);
    if (!facts) {
        Py_DECREF(data);
        return NULL;
    }
    return Py_BuildValue("(iiONNidN)", r->up_fd, r->code, r->extra ? Py_True : Py_False,
                         PyUnicode_DecodeUTF8(r->message, (Py_ssize_t)strlen(r->message), "replace"), data,
                         r->err, r->sent_at, facts);
}

/* The scanner's state as Python's ChunkedScanner.snapshot() gives it: (state, remaining, line). */
static PyObject *scan_state(const job_t *j) {
    return Py_BuildValue("(iKy#)", j->state, (unsigned long long)j->remaining, j->line, (Py_ssize_t)j->line_len);
}

static PyObject *Pump_withdraw(Pump *p, PyObject *arg) {
    long value = PyLong_AsLong(arg);
    if (value == -1 && PyErr_Occurred()) return NULL;
    int up_fd = value < 0 || value > INT32_MAX ? -1 : (int)value;
    double sent_at = 0;
    result_t ended;
    int found = 0, had_job = 0;
    job_t state = {0}; /* the withdrawn job's scanner state and facts, copied out under the lock */
    lock_from_python(p);
    if (up_fd >= 0 && (size_t)up_fd < p->jobs_cap && p->jobs[up_fd]) {
        job_t *j = p->jobs[up_fd];
        sent_at = j->sent_at;
        state.facts = j->facts; /* the tail moves here */
        j->facts.tail = NULL;
        state.state = j->in_head ? S_SIZE : j->state;
        state.remaining = j->in_head ? 0 : j->remaining;
        state.line_len = j->in_head ? 0 : j->line_len;
        memcpy(state.line, j->line, state.line_len);
        had_job = 1;
        drop(p, j);
    }
    size_t k = 0;
    for (size_t i = 0; i < p->results_len; i++) {
        if (p->results[i].up_fd != up_fd) {
            p->results[k++] = p->results[i];
            continue;
        }
        if (!found) {
            ended = p->results[i];
            found = 1;
        } else {
            free(p->results[i].data);
            free(p->results[i].facts.tail);
        }
    }
    p->results_len = k;
    pthread_mutex_unlock(&p->mu);
    PyObject *where = had_job ? scan_state(&state) : Py_NewRef(Py_None);
    PyObject *facts = where ? facts_tuple(p, &state.facts) : NULL;
    free(state.facts.tail);
    if (!facts) {
        Py_XDECREF(where);
        if (found) {
            free(ended.data);
            free(ended.facts.tail);
        }
        return NULL;
    }
    if (!found) return Py_BuildValue("(dONN)", sent_at, Py_None, where, facts);
    PyObject *t = result_tuple(p, &ended);
    free(ended.data);
    free(ended.facts.tail);
    if (!t) {
        Py_DECREF(where);
        Py_DECREF(facts);
        return NULL;
    }
    return Py_BuildValue("(dNNN)", ended.sent_at, t, where, facts);
}

static PyObject *Pump_collect(Pump *p, PyObject *Py_UNUSED(ignored)) {
    uint64_t count;
    ssize_t r = read(p->notify_fd, &count, sizeof count);
    (void)r;
    lock_from_python(p);
    size_t n = p->results_len;
    result_t *taken = NULL;
    if (n) {
        taken = malloc(n * sizeof(result_t));
        if (taken) {
            memcpy(taken, p->results, n * sizeof(result_t));
            p->results_len = 0;
        }
    }
    /* The eventfd was read above and the queue is taken: results pushed from now on need a new
     * signal (also when there was nothing to take, after a withdraw dropped a signalled result). */
    if (!n || taken) p->signalled = 0;
    pthread_mutex_unlock(&p->mu);
    if (n && !taken) return PyErr_NoMemory();
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out && i < n; i++) {
        PyObject *t = result_tuple(p, &taken[i]);
        if (!t) Py_CLEAR(out);
        else PyList_SET_ITEM(out, (Py_ssize_t)i, t);
    }
    for (size_t i = 0; i < n; i++) {
        free(taken[i].data);
        free(taken[i].facts.tail);
    }
    free(taken);
    return out;
}

static PyObject *Pump_stats(Pump *p, PyObject *Py_UNUSED(ignored)) {
    lock_from_python(p);
    size_t streams = p->streams, blocked = p->blocked;
    pthread_mutex_unlock(&p->mu);
    return Py_BuildValue("(nn)", (Py_ssize_t)streams, (Py_ssize_t)blocked);
}

static PyObject *Pump_counters(Pump *p, PyObject *Py_UNUSED(ignored)) {
    lock_from_python(p);
    unsigned long long wakeups = p->wakeups, pauses = p->pauses, reads = p->reads;
    pthread_mutex_unlock(&p->mu);
    return Py_BuildValue("(KKK)", wakeups, pauses, reads);
}

static PyObject *Pump_close(Pump *p, PyObject *Py_UNUSED(ignored)) {
    return stop_thread(p);
}

static PyObject *Pump_notify_fd(Pump *p, void *Py_UNUSED(closure)) { return PyLong_FromLong(p->notify_fd); }

static PyMethodDef Pump_methods[] = {
    {"add", (PyCFunction)Pump_add, METH_VARARGS,
     "add(up_fd, client_fd, state, remaining, line, since=0.0, want_tail=False): relay the rest of a "
     "chunked body (since: when its last event went out before, for the first gap)"},
    {"respond", (PyCFunction)Pump_respond, METH_VARARGS,
     "respond(up_fd, client_fd, suffix, want_tail=False): relay a response from its head (or hand the head "
     "back)"},
    {"withdraw", (PyCFunction)Pump_withdraw, METH_O,
     "withdraw(up_fd) -> (when the job's response head went out (0.0: it had not, or no job), "
     "its result if it had ended and the result was not collected yet, else None, "
     "its chunk scanner's (state, remaining, line) if it was running, else None, "
     "its facts (as collect's) if it was running, else None)"},
    {"collect", (PyCFunction)Pump_collect, METH_NOARGS,
     "collect() -> [(up_fd, code, extra, message, data, errno, sent_at, facts)] for the jobs that ended; "
     "facts: (events, first_at, last_at, gap_sum, gap counts per bucket, tail or None) or None"},
    {"stats", (PyCFunction)Pump_stats, METH_NOARGS, "stats() -> (streams, blocked on a slow client)"},
    {"counters", (PyCFunction)Pump_counters, METH_NOARGS,
     "counters() -> (wake-ups, coalescing pauses, engine reads that brought bytes), since the start"},
    {"close", (PyCFunction)Pump_close, METH_NOARGS, "close() -> up_fds of the jobs still running"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Pump_getset[] = {
    {"notify_fd", (getter)Pump_notify_fd, NULL, "readable when collect() has results", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PumpType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "router._pump.Pump",
    .tp_basicsize = sizeof(Pump),
    .tp_dealloc = (destructor)Pump_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The relay pump's native thread (see router/relay.py).",
    .tp_methods = Pump_methods,
    .tp_getset = Pump_getset,
    .tp_new = Pump_new,
};

static PyObject *module_client_head(PyObject *Py_UNUSED(m), PyObject *args) {
    const char *head, *suffix;
    Py_ssize_t head_len, suffix_len;
    if (!PyArg_ParseTuple(args, "y#y#", &head, &head_len, &suffix, &suffix_len)) return NULL;
    size_t out_len;
    int keep;
    char *out = client_head(head, (size_t)head_len, suffix, (size_t)suffix_len, &out_len, &keep);
    if (!out) Py_RETURN_NONE;
    PyObject *r = Py_BuildValue("(y#O)", out, (Py_ssize_t)out_len, keep ? Py_True : Py_False);
    free(out);
    return r;
}

/* scan(), the pump thread's own scanner, on a job of its own: for the differential test. */
static PyObject *module_scan_chunked(PyObject *Py_UNUSED(m), PyObject *args) {
    int state;
    unsigned long long remaining;
    const char *line, *data;
    Py_ssize_t line_len, n;
    if (!PyArg_ParseTuple(args, "iKy#y#", &state, &remaining, &line, &line_len, &data, &n)) return NULL;
    job_t *j = scanner_job(state, S_DONE, remaining, line, line_len);
    if (!j) return NULL;
    char err[120] = "";
    ssize_t used;
    Py_BEGIN_ALLOW_THREADS
    used = scan(j, data, (size_t)n, err, sizeof err);
    Py_END_ALLOW_THREADS
    PyObject *where = scan_state(j);
    unsigned long long events = j->facts.events;
    free(j);
    if (!where) return NULL;
    if (used < 0) return Py_BuildValue("(nNsK)", (Py_ssize_t)-1, where, err, events);
    return Py_BuildValue("(nNOK)", (Py_ssize_t)used, where, Py_None, events);
}

static PyMethodDef module_methods[] = {
    {"scan_chunked", module_scan_chunked, METH_VARARGS,
     "scan_chunked(state, remaining, line, data) -> (bytes of data in the body or -1, "
     "(state, remaining, line) after, the error or None, chunks begun): the pump thread's chunk scanner, for tests"},
    {"client_head", module_client_head, METH_VARARGS,
     "client_head(head, suffix) -> (client head, engine keeps the connection) or None: what the "
     "thread writes for an engine head (without its blank line), for tests"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "router._pump", "The router's relay pump as a native thread.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__pump(void) {
    if (PyType_Ready(&PumpType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&PumpType);
    if (PyModule_AddObject(m, "Pump", (PyObject *)&PumpType) < 0) {
        Py_DECREF(&PumpType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "DONE", R_DONE) < 0 || PyModule_AddIntConstant(m, "ENGINE", R_ENGINE) < 0 ||
        PyModule_AddIntConstant(m, "CLIENT", R_CLIENT) < 0 || PyModule_AddIntConstant(m, "HEAD", R_HEAD) < 0 ||
        PyModule_AddIntConstant(m, "EARLY", R_EARLY) < 0 || PyModule_AddIntConstant(m, "MAX_HEAD", MAX_HEAD_BYTES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
