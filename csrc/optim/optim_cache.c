/* optim_cache.c - the on-disk record of the loop variants optim_tune.c
 * chose, so that a second process (a restart, the next run of a script)
 * reuses a choice instead of measuring again.
 *
 * A plain text file, never anything executable or unpickled: a header line,
 * then one line per size class, "<key>\t<variant name>\t<busy>\n" (busy:
 * 1 when measured on a busy machine, [Note: busy machine] in optim_tune.c;
 * else 0). The key names
 * everything a choice depends on (flatshard's version, the CPU, the class:
 * optim_tune.c's class_key); the value is a variant name that
 * fs_optim_variant_parse checks like any other. The file is untrusted input:
 * a file that cannot be read, has another header, or a line that is too
 * long, has no tab or names no valid variant, is ignored (the class is
 * measured again and its line rewritten). Writes go to a temporary file in
 * the same folder, renamed over the old one, so a reader sees the old file
 * or the new one, never half of one. Two processes that store at the same
 * moment may drop each other's new line: the loser's class is measured
 * again by a later process, nothing worse.
 *
 * Where the file is, is the caller's to say (python/flatshard/optim/
 * tune_cache.py: an environment variable or the user's cache folder); with
 * no path set, nothing is read or written.
 */
#define _POSIX_C_SOURCE 200809L /* strdup, getpid */
#include "optim.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

/* 2: a busy machine's choice keeps the default split (the OpenMP team);
 * files of 1 may hold busy choices on started threads, which lost to it. */
#define CACHE_HEADER "flatshard optim tune cache 2"
#define CACHE_LINE_MAX 512
#define CACHE_LINES_MAX 1024

static pthread_mutex_t cache_lock = PTHREAD_MUTEX_INITIALIZER;
static char *cache_path;    /* NULL: no cache */
static char *cache_version; /* flatshard's version, the first field of every key */

fs_status fs_tune_cache_set(const char *path, const char *version)
{
    char *p = path && *path ? strdup(path) : NULL, *v = strdup(version ? version : "");
    if ((path && *path && !p) || !v) {
        free(p);
        free(v);
        return FS_ERR_NO_MEMORY;
    }
    for (char *c = v; *c; c++)
        if (*c <= ' ' || *c > '~')
            *c = '_';
    pthread_mutex_lock(&cache_lock);
    free(cache_path);
    free(cache_version);
    cache_path = p;
    cache_version = v;
    pthread_mutex_unlock(&cache_lock);
    return FS_OK;
}

int fs_tune_cache_path(char *out, size_t cap)
{
    pthread_mutex_lock(&cache_lock);
    int have = cache_path != NULL;
    if (cap)
        snprintf(out, cap, "%s", have ? cache_path : "");
    pthread_mutex_unlock(&cache_lock);
    return have;
}

/* The CPU as the key needs it: vendor, family, model, stepping and brand
 * string from cpuid (other architectures: the architecture's name). */
static void cpu_id(char *out, size_t cap)
{
#if defined(__x86_64__) || defined(__i386__)
    unsigned a = 0, b = 0, c = 0, d = 0, vendor[4] = {0};
    char brand[49] = {0};
    __get_cpuid(0, &a, &vendor[0], &vendor[2], &vendor[1]);
    __get_cpuid(1, &a, &b, &c, &d);
    unsigned family = (a >> 8) & 0xf, model = (a >> 4) & 0xf, stepping = a & 0xf;
    if (family == 0xf)
        family += (a >> 20) & 0xff;
    if (family >= 6)
        model |= ((a >> 16) & 0xf) << 4;
    if (__get_cpuid_max(0x80000000, NULL) >= 0x80000004)
        for (unsigned k = 0; k < 3; k++)
            __get_cpuid(0x80000002 + k, (unsigned *)(brand + 16 * k),
                        (unsigned *)(brand + 16 * k + 4), (unsigned *)(brand + 16 * k + 8),
                        (unsigned *)(brand + 16 * k + 12));
    snprintf(out, cap, "%.12s/family%u/model%u/stepping%u/%s", (const char *)vendor, family,
             model, stepping, brand);
#elif defined(__aarch64__)
    snprintf(out, cap, "aarch64");
#else
    snprintf(out, cap, "unknown-cpu");
#endif
    for (char *p = out; *p; p++) /* one field: no blanks, tabs or newlines */
        if (*p <= ' ' || *p > '~')
            *p = '_';
}

int fs_tune_cache_key(const char *cls, char *out, size_t cap)
{
    char cpu[160];
    cpu_id(cpu, sizeof cpu);
    pthread_mutex_lock(&cache_lock);
    int have = cache_path != NULL;
    if (have)
        snprintf(out, cap, "%s %s %s", cache_version, cpu, cls);
    pthread_mutex_unlock(&cache_lock);
    return have;
}

/* The file's lines after a valid header, or NULL (no file, unreadable, or
 * another header); *count: how many. Each line without its newline. */
static char **read_lines(const char *path, int *count)
{
    *count = 0;
    FILE *f = fopen(path, "r");
    if (!f)
        return NULL;
    char line[CACHE_LINE_MAX + 2];
    char **lines = NULL;
    if (!fgets(line, sizeof line, f) || strcmp(line, CACHE_HEADER "\n") != 0 ||
        !(lines = calloc(CACHE_LINES_MAX, sizeof *lines))) {
        fclose(f);
        return NULL;
    }
    int skipping = 0; /* in the rest of a line too long to keep */
    while (*count < CACHE_LINES_MAX && fgets(line, sizeof line, f)) {
        size_t len = strlen(line);
        int whole = len > 0 && line[len - 1] == '\n';
        if (skipping || !whole) {
            skipping = !whole;
            continue;
        }
        line[len - 1] = '\0';
        if (!strchr(line, '\t'))
            continue;
        if (!(lines[*count] = strdup(line)))
            break;
        (*count)++;
    }
    fclose(f);
    return lines;
}

static void free_lines(char **lines, int count)
{
    for (int k = 0; k < count; k++)
        free(lines[k]);
    free(lines);
}

int fs_tune_cache_load(const char *key, fs_optim_variant *out, int *busy)
{
    char path[4096];
    if (!fs_tune_cache_path(path, sizeof path))
        return 0;
    int count = 0, found = 0;
    char **lines = read_lines(path, &count);
    const size_t klen = strlen(key);
    for (int k = count - 1; k >= 0 && !found; k--) { /* the last line of a key wins */
        char *value = lines[k] + klen + 1, *flag;
        if (strncmp(lines[k], key, klen) != 0 || lines[k][klen] != '\t' ||
            !(flag = strchr(value, '\t')) || (strcmp(flag, "\t0") != 0 && strcmp(flag, "\t1") != 0))
            continue;
        *flag = '\0';
        found = fs_optim_variant_parse(value, out) == FS_OK;
        *busy = flag[1] == '1';
    }
    free_lines(lines, count);
    return found;
}

int fs_tune_cache_store(const char *key, const fs_optim_variant *v, int busy)
{
    char path[4096], tmp[4200], name[FS_OPTIM_VARIANT_NAME_MAX];
    if (!fs_tune_cache_path(path, sizeof path) || strlen(key) + 4 + sizeof name > CACHE_LINE_MAX)
        return 0;
    fs_optim_variant_name(v, name);
    snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path, (long)getpid());
    pthread_mutex_lock(&cache_lock); /* one writer per process at a time */
    int count = 0, ok = 0;
    char **lines = read_lines(path, &count);
    FILE *f = fopen(tmp, "w");
    if (f) {
        const size_t klen = strlen(key);
        ok = fputs(CACHE_HEADER "\n", f) >= 0;
        /* the other classes' lines, oldest dropped first when the file is full */
        for (int k = count >= CACHE_LINES_MAX ? 1 : 0; k < count && ok; k++)
            if (!(strncmp(lines[k], key, klen) == 0 && lines[k][klen] == '\t'))
                ok = fprintf(f, "%s\n", lines[k]) >= 0;
        ok = ok && fprintf(f, "%s\t%s\t%d\n", key, name, busy ? 1 : 0) >= 0;
        ok = fclose(f) == 0 && ok;
        ok = ok && rename(tmp, path) == 0;
        if (!ok)
            remove(tmp);
    }
    pthread_mutex_unlock(&cache_lock);
    free_lines(lines, count);
    return ok;
}
