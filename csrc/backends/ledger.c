/* ledger.c - the collective ledger (ledger.h). */
#include "ledger.h"

#include <stdio.h>
#include <string.h>

void fs_ledger_init(fs_ledger *l) { memset(l, 0, sizeof *l); }

uint64_t fs_ledger_issue(fs_ledger *l, fs_ledger_op op, const char *unit, int64_t count,
                         fs_dtype t)
{
    fs_ledger_entry *e = &l->ring[l->count % FS_LEDGER_CAP];
    e->seq = ++l->count;
    e->op = op;
    e->state = FS_LEDGER_ISSUED;
    e->dtype = t;
    e->bytes = count * (int64_t)fs_dtype_size(t);
    /* Once per collective: a bounded copy, not snprintf (whose format
     * parsing costs more than a small unit's all-gather). */
    size_t n = 0;
    while (unit && n < sizeof e->unit && unit[n]) /* bounded: labels can be long */
        n++;
    memcpy(e->unit, unit ? unit : "", n < sizeof e->unit ? n + 1 : sizeof e->unit - 1);
    if (n >= sizeof e->unit) { /* cut short: do not end inside a UTF-8 character */
        e->unit[sizeof e->unit - 1] = 0;
        n = sizeof e->unit - 1;
        size_t lead = n;
        while (lead > 0 && ((unsigned char)e->unit[lead - 1] & 0xC0) == 0x80)
            lead--;
        if (lead > 0) {
            unsigned char c = (unsigned char)e->unit[lead - 1];
            size_t len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
            if (lead - 1 + len > n)
                e->unit[lead - 1] = 0;
        }
    }
    return e->seq;
}

void fs_ledger_finish(fs_ledger *l, uint64_t seq, fs_status s, int on_device)
{
    fs_ledger_entry *e = (fs_ledger_entry *)fs_ledger_get(l, seq);
    if (e)
        e->state = s != FS_OK ? FS_LEDGER_FAILED
                   : on_device ? FS_LEDGER_ENQUEUED : FS_LEDGER_COMPLETED;
}

const fs_ledger_entry *fs_ledger_get(const fs_ledger *l, uint64_t seq)
{
    if (seq == 0 || seq > l->count || l->count - seq >= FS_LEDGER_CAP)
        return NULL;
    return &l->ring[(seq - 1) % FS_LEDGER_CAP];
}

const char *fs_ledger_op_name(fs_ledger_op op)
{
    static const char *names[] = {"all_gather", "reduce_scatter", "all_reduce", "broadcast",
                                  "barrier", "all_to_all"};
    return (unsigned)op < sizeof names / sizeof *names ? names[op] : "unknown";
}

const char *fs_ledger_state_name(fs_ledger_state s)
{
    static const char *names[] = {"issued", "completed", "failed", "enqueued"};
    return (unsigned)s < sizeof names / sizeof *names ? names[s] : "unknown";
}

/* 1536 -> "1.5 KiB": sizes read at a glance in an error message. */
static void human_bytes(int64_t b, char *buf, size_t cap)
{
    static const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)b;
    int u = 0;
    while (v >= 1024 && u < 4) {
        v /= 1024;
        u++;
    }
    if (u == 0)
        snprintf(buf, cap, "%lld B", (long long)b);
    else
        snprintf(buf, cap, "%.1f %s", v, units[u]);
}

int fs_ledger_format(const fs_ledger_entry *e, int with_state, char *buf, size_t cap)
{
    char size[32];
    human_bytes(e->bytes, size, sizeof size);
    /* %.*s: an entry read from another process may be torn mid-update. */
    return snprintf(buf, cap, "%s #%llu for '%.*s' (%s %s%s%s)", fs_ledger_op_name(e->op),
                    (unsigned long long)e->seq, FS_LEDGER_UNIT - 1, e->unit[0] ? e->unit : "-",
                    size, fs_dtype_name(e->dtype), with_state ? ", " : "",
                    with_state ? fs_ledger_state_name(e->state) : "");
}

void fs_ledger_tail(const fs_ledger *l, int n, const char *head, char *buf, size_t cap)
{
    size_t len = (size_t)snprintf(buf, cap, "%s", head);
    uint64_t first = l->count > (uint64_t)n ? l->count - (uint64_t)n + 1 : 1;
    for (uint64_t seq = first; seq <= l->count && len < cap; seq++) {
        const fs_ledger_entry *e = fs_ledger_get(l, seq);
        if (!e)
            continue;
        len += (size_t)snprintf(buf + len, cap - len, "\n  ");
        if (len < cap)
            len += (size_t)fs_ledger_format(e, 1, buf + len, cap - len);
    }
    if (l->count == 0 && len < cap)
        snprintf(buf + len, cap - len, " none yet");
}
