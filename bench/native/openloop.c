/* An open-loop HTTP/1.1 load generator in one thread: POSTs request i at t0 + i / rate over keep-alive
 * connections, whatever the server's latency, and writes each request's scheduled, sent and answered times.
 *
 * bench/native_loadgen.py builds and runs it beside bench/loadgen.py's Python client, with the same rules: a
 * request due while every connection is busy is skipped (never queued), latency counts from the scheduled send
 * time, a request not answered within the timeout fails and its connection is replaced. One thread, epoll and a
 * timer at the next send's time (timer slack 1 ns): what it adds to a request's latency is a wake-up and a
 * write, not an interpreter's.
 *
 * Usage: openloop HOST PORT PATH RATE COUNT CONNECTIONS TIMEOUT_MS BODIES OUT
 *   BODIES: each body as "<length>\n" followed by its bytes; request i sends body i % (number of bodies).
 *   OUT: "t0_epoch_ns <ns>" on the first line, then one line per request, tab-separated: index, scheduled,
 *   sent and done (ns after t0; sent and done -1 when it never left), status (the HTTP status; -1 skipped,
 *   0 no response), X-Model-Version, Server-Timing, error (empty fields as "-").
 * Exit status 2 for bad arguments or files; 0 otherwise (failed requests are results, not errors).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#define FIELD 256

typedef struct {
    int64_t scheduled, sent, done;
    int status;
    char version[64];
    char timing[FIELD];
    char error[96];
} record_t;

typedef struct {
    int fd;                /* -1: not connected */
    long request;          /* the request in flight, -1 when idle */
    size_t wrote;          /* bytes of the request written so far */
    int want_out;          /* registered for EPOLLOUT */
    char *buf;             /* the response read so far */
    size_t len, cap;
} conn_t;

static struct sockaddr_storage address;
static socklen_t address_len;
static int epfd;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void fail(const char *what) {
    fprintf(stderr, "openloop: %s\n", what);
    exit(2);
}

/* Copies a header value into `out` (at most size - 1 bytes), tabs and line ends as spaces. */
static void copy_value(char *out, size_t size, const char *value, size_t n) {
    while (n && (*value == ' ' || *value == '\t')) value++, n--;
    while (n && (value[n - 1] == ' ' || value[n - 1] == '\t')) n--;
    if (n >= size) n = size - 1;
    for (size_t i = 0; i < n; i++) out[i] = (value[i] == '\t' || value[i] == '\r' || value[i] == '\n') ? ' ' : value[i];
    out[n] = '\0';
}

static int open_connection(conn_t *c, char *error, size_t error_size) {
    int fd = socket(address.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        snprintf(error, error_size, "socket: %s", strerror(errno));
        return -1;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(fd, (struct sockaddr *)&address, address_len) != 0) {
        snprintf(error, error_size, "connect: %s", strerror(errno));
        close(fd);
        return -1;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
    epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev);
    c->fd = fd;
    c->want_out = 0;
    c->len = 0;
    return 0;
}

static void close_connection(conn_t *c) {
    if (c->fd >= 0) {
        epoll_ctl(epfd, EPOLL_CTL_DEL, c->fd, NULL);
        close(c->fd);
    }
    c->fd = -1;
    c->request = -1;
    c->len = 0;
    c->want_out = 0;
}

static void set_out(conn_t *c, int on) {
    if (c->want_out == on) return;
    struct epoll_event ev = {.events = EPOLLIN | (on ? EPOLLOUT : 0), .data.ptr = c};
    epoll_ctl(epfd, EPOLL_CTL_MOD, c->fd, &ev);
    c->want_out = on;
}

static void finish(conn_t *c, record_t *records, int status, const char *error) {
    record_t *r = &records[c->request];
    r->done = now_ns();
    r->status = status;
    if (error) snprintf(r->error, sizeof r->error, "%s", error);
    c->request = -1;
}

/* Fails the connection's request (if any) with `error` and drops the connection. */
static void broken(conn_t *c, record_t *records, const char *error) {
    if (c->request >= 0) finish(c, records, 0, error);
    close_connection(c);
}

/* Writes what is left of the request; 0 when written or waiting for room, -1 when the connection broke. */
static int write_some(conn_t *c, const char *const *requests, const size_t *lengths, long nbodies,
                      record_t *records) {
    long body = c->request % nbodies;
    while (c->wrote < lengths[body]) {
        ssize_t n = write(c->fd, requests[body] + c->wrote, lengths[body] - c->wrote);
        if (n > 0) {
            c->wrote += (size_t)n;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            set_out(c, 1);
            return 0;
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else {
            char error[96];
            snprintf(error, sizeof error, "write: %s", n < 0 ? strerror(errno) : "nothing written");
            broken(c, records, error);
            return -1;
        }
    }
    set_out(c, 0);
    return 0;
}

/* Reads what the connection holds; finishes its request once the whole response is in. */
static void read_some(conn_t *c, record_t *records) {
    for (;;) {
        if (c->cap - c->len < 4096) {
            c->cap = c->cap ? 2 * c->cap : 65536;
            c->buf = realloc(c->buf, c->cap);
            if (!c->buf) fail("out of memory");
        }
        ssize_t n = read(c->fd, c->buf + c->len, c->cap - c->len - 1);
        if (n > 0) {
            c->len += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        /* The peer closed (n == 0) or the connection failed: an idle connection is replaced quietly (uvicorn
         * ends idle keep-alive connections after 5 s), a busy one fails its request. */
        char error[96];
        snprintf(error, sizeof error, "%s", n == 0 ? "connection closed by the server" : strerror(errno));
        broken(c, records, error);
        return;
    }
    if (c->request < 0) {
        if (c->len) broken(c, records, NULL); /* bytes nobody asked for: start clean */
        return;
    }
    c->buf[c->len] = '\0';
    char *end = strstr(c->buf, "\r\n\r\n");
    if (!end) return;
    size_t head = (size_t)(end - c->buf) + 4;
    record_t *r = &records[c->request];
    int status = 0;
    if (sscanf(c->buf, "HTTP/1.%*d %d", &status) != 1) {
        broken(c, records, "not an HTTP/1.x response");
        return;
    }
    long length = -1;
    int closes = 0;
    for (char *line = strstr(c->buf, "\r\n") + 2; line < end; line = strstr(line, "\r\n") + 2) {
        char *eol = strstr(line, "\r\n");
        char *colon = memchr(line, ':', (size_t)(eol - line));
        if (!colon) continue;
        size_t name = (size_t)(colon - line);
        const char *value = colon + 1;
        size_t n = (size_t)(eol - value);
        if (name == 14 && strncasecmp(line, "content-length", 14) == 0) length = strtol(value, NULL, 10);
        else if (name == 15 && strncasecmp(line, "x-model-version", 15) == 0)
            copy_value(r->version, sizeof r->version, value, n);
        else if (name == 13 && strncasecmp(line, "server-timing", 13) == 0)
            copy_value(r->timing, sizeof r->timing, value, n);
        else if (name == 10 && strncasecmp(line, "connection", 10) == 0) {
            char token[16];
            copy_value(token, sizeof token, value, n);
            closes = strcasecmp(token, "close") == 0;
        }
    }
    if (length < 0) {
        broken(c, records, "a response without Content-Length");
        return;
    }
    if (c->len < head + (size_t)length) return;
    finish(c, records, status, NULL);
    if (closes || c->len > head + (size_t)length) close_connection(c); /* the next request opens another */
    else c->len = 0;
}

static void record_error(record_t *r, const char *error) {
    r->sent = r->done = now_ns();
    r->status = 0;
    snprintf(r->error, sizeof r->error, "%s", error);
}

int main(int argc, char **argv) {
    if (argc != 10) fail("usage: openloop HOST PORT PATH RATE COUNT CONNECTIONS TIMEOUT_MS BODIES OUT");
    const char *host = argv[1], *port = argv[2], *path = argv[3];
    double rate = atof(argv[4]);
    long count = atol(argv[5]), nconns = atol(argv[6]);
    int64_t timeout = (int64_t)atol(argv[7]) * 1000000LL;
    if (!(rate > 0) || count < 1 || nconns < 1 || timeout <= 0) fail("RATE, COUNT, CONNECTIONS and TIMEOUT_MS must be > 0");

    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *found;
    int gai = getaddrinfo(host, port, &hints, &found);
    if (gai != 0) {
        fprintf(stderr, "openloop: %s:%s: %s\n", host, port, gai_strerror(gai));
        return 2;
    }
    memcpy(&address, found->ai_addr, found->ai_addrlen);
    address_len = found->ai_addrlen;
    freeaddrinfo(found);

    /* The requests, whole, before the run. */
    FILE *in = fopen(argv[8], "rb");
    if (!in) fail("cannot open BODIES");
    long nbodies = 0, capacity = 16;
    char **requests = malloc(capacity * sizeof *requests);
    size_t *lengths = malloc(capacity * sizeof *lengths);
    long length;
    while (fscanf(in, "%ld", &length) == 1) {
        if (fgetc(in) != '\n' || length < 0) fail("BODIES: a length must be followed by a line end");
        if (nbodies == capacity) {
            capacity *= 2;
            requests = realloc(requests, capacity * sizeof *requests);
            lengths = realloc(lengths, capacity * sizeof *lengths);
        }
        char head[1024];
        int h = snprintf(head, sizeof head, "POST %s HTTP/1.1\r\nHost: %s:%s\r\nContent-Type: application/json\r\n"
                         "Content-Length: %ld\r\n\r\n", path, host, port, length);
        if (h < 0 || (size_t)h >= sizeof head) fail("PATH too long");
        requests[nbodies] = malloc((size_t)h + (size_t)length);
        memcpy(requests[nbodies], head, (size_t)h);
        if (fread(requests[nbodies] + h, 1, (size_t)length, in) != (size_t)length) fail("BODIES: a body is cut short");
        lengths[nbodies++] = (size_t)h + (size_t)length;
    }
    fclose(in);
    if (nbodies == 0) fail("BODIES holds no body");

    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    epfd = epoll_create1(EPOLL_CLOEXEC);
    int timer = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    struct epoll_event tev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(epfd, EPOLL_CTL_ADD, timer, &tev);

    record_t *records = calloc((size_t)count, sizeof *records);
    conn_t *conns = calloc((size_t)nconns, sizeof *conns);
    for (long i = 0; i < count; i++) records[i].sent = records[i].done = -1;
    char error[96];
    for (long k = 0; k < nconns; k++) {
        conns[k].fd = -1;
        conns[k].request = -1;
        open_connection(&conns[k], error, sizeof error); /* a refused one is retried when it is needed */
    }

    struct timespec wall;
    clock_gettime(CLOCK_REALTIME, &wall);
    int64_t mono = now_ns();
    int64_t t0 = mono + 20000000LL; /* the first send 20 ms from now */
    int64_t t0_epoch = (int64_t)wall.tv_sec * 1000000000LL + wall.tv_nsec + (t0 - mono);
    long next = 0, inflight = 0;
    struct epoll_event events[64];
    while (next < count || inflight > 0) {
        int64_t now = now_ns();
        while (next < count) {
            int64_t due = t0 + (int64_t)((double)next * 1e9 / rate);
            if (due > now) break;
            record_t *r = &records[next];
            r->scheduled = due - t0;
            conn_t *c = NULL;
            for (long k = 0; k < nconns && !c; k++)
                if (conns[k].request < 0) c = &conns[k];
            if (!c) {
                r->status = -1; /* due while every connection was busy: skipped */
            } else if (c->fd < 0 && open_connection(c, error, sizeof error) != 0) {
                record_error(r, error);
            } else {
                c->request = next;
                c->wrote = 0;
                c->len = 0;
                r->sent = now_ns();
                inflight++;
                write_some(c, (const char *const *)requests, lengths, nbodies, records);
            }
            next++;
            now = now_ns();
        }
        /* Timeouts: the request fails and its connection is replaced. */
        int64_t wait_until = next < count ? t0 + (int64_t)((double)next * 1e9 / rate) : now + 100000000LL;
        for (long k = 0; k < nconns; k++) {
            conn_t *c = &conns[k];
            if (c->request < 0) continue;
            int64_t deadline = records[c->request].sent + timeout;
            if (deadline <= now) broken(c, records, "timed out");
            else if (deadline < wait_until) wait_until = deadline;
        }
        inflight = 0;
        for (long k = 0; k < nconns; k++) inflight += conns[k].request >= 0;
        if (next >= count && inflight == 0) break;
        struct itimerspec at = {.it_value = {.tv_sec = wait_until / 1000000000LL, .tv_nsec = wait_until % 1000000000LL}};
        if (at.it_value.tv_sec == 0 && at.it_value.tv_nsec == 0) at.it_value.tv_nsec = 1;
        timerfd_settime(timer, TFD_TIMER_ABSTIME, &at, NULL);
        int n = epoll_wait(epfd, events, 64, -1);
        for (int e = 0; e < n; e++) {
            conn_t *c = events[e].data.ptr;
            if (!c) {
                uint64_t expirations;
                while (read(timer, &expirations, sizeof expirations) > 0) {}
                continue;
            }
            if (c->fd < 0) continue; /* dropped earlier in this round */
            if ((events[e].events & EPOLLOUT) && c->request >= 0)
                if (write_some(c, (const char *const *)requests, lengths, nbodies, records) != 0) continue;
            if (events[e].events & (EPOLLIN | EPOLLERR | EPOLLHUP)) read_some(c, records);
        }
        inflight = 0;
        for (long k = 0; k < nconns; k++) inflight += conns[k].request >= 0;
    }

    FILE *out = fopen(argv[9], "w");
    if (!out) fail("cannot open OUT");
    fprintf(out, "t0_epoch_ns %lld\n", (long long)t0_epoch);
    for (long i = 0; i < count; i++) {
        record_t *r = &records[i];
        int64_t sent = r->sent < 0 ? -1 : r->sent - t0, done = r->done < 0 ? -1 : r->done - t0;
        fprintf(out, "%ld\t%lld\t%lld\t%lld\t%d\t%s\t%s\t%s\n", i, (long long)r->scheduled, (long long)sent,
                (long long)done, r->status, r->version[0] ? r->version : "-", r->timing[0] ? r->timing : "-",
                r->error[0] ? r->error : "-");
    }
    if (fclose(out) != 0) fail("cannot write OUT");
    return 0;
}
