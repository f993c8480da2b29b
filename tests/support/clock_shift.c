/* An LD_PRELOAD shim for redis-server in tests: shifts the wall clock (CLOCK_REALTIME,
 * gettimeofday, time) by the number of microseconds written in the file named by
 * DLIMIT_CLOCK_SHIFT_FILE (re-read every 5 ms), as an NTP step would; the monotonic clock is
 * untouched. It reads the real clock with the raw system call and never allocates, so it is
 * safe inside jemalloc's own initialisation (where libfaketime is not).
 * With DLIMIT_CLOCK_PIN_FILE set instead, the wall clock stands still at the microseconds
 * since the epoch written in that file, re-read on every reading, so a test moves it exactly
 * (tests/model/conformance.rs, which writes it by rename); until a time is written, the real
 * clock. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static long long shift_us(void) {
    static long long shift = 0;
    static long long read_at = -1;
    struct timespec mono;
    syscall(SYS_clock_gettime, CLOCK_MONOTONIC, &mono);
    long long now = mono.tv_sec * 1000000LL + mono.tv_nsec / 1000;
    if (read_at >= 0 && now - read_at < 5000) {
        return shift;
    }
    read_at = now;
    const char *path = getenv("DLIMIT_CLOCK_SHIFT_FILE");
    if (!path) {
        return shift;
    }
    int fd = open(path, O_RDONLY);
    if (fd < 0) {
        return shift;
    }
    char buf[32];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n > 0) {
        buf[n] = 0;
        shift = strtoll(buf, NULL, 10);
    }
    return shift;
}

/* The pinned time in µs, or -1 when the clock is not pinned. */
static long long pinned_us(void) {
    const char *path = getenv("DLIMIT_CLOCK_PIN_FILE");
    if (!path) {
        return -1;
    }
    /* The last time read: a file caught empty (being rewritten) keeps it. */
    static long long last = -1;
    int fd = open(path, O_RDONLY);
    if (fd < 0) {
        return last;
    }
    char buf[32];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n > 0) {
        buf[n] = 0;
        last = strtoll(buf, NULL, 10);
    }
    return last;
}

static void shifted(struct timespec *ts) {
    long long pin = pinned_us();
    if (pin >= 0) {
        ts->tv_sec = pin / 1000000LL;
        ts->tv_nsec = (pin % 1000000LL) * 1000LL;
        return;
    }
    long long ns = ts->tv_sec * 1000000000LL + ts->tv_nsec + shift_us() * 1000LL;
    ts->tv_sec = ns / 1000000000LL;
    ts->tv_nsec = ns % 1000000000LL;
}

int clock_gettime(clockid_t clock, struct timespec *ts) {
    int result = (int)syscall(SYS_clock_gettime, clock, ts);
    if (result == 0 && (clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE)) {
        shifted(ts);
    }
    return result;
}

int gettimeofday(struct timeval *tv, void *tz) {
    (void)tz;
    struct timespec ts;
    int result = clock_gettime(CLOCK_REALTIME, &ts);
    if (result == 0 && tv) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return result;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out) {
        *out = ts.tv_sec;
    }
    return ts.tv_sec;
}
