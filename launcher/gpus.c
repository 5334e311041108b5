/*
 * gpus.c — which NVIDIA GPUs a rank can use, and in what order CUDA
 * numbers them, from the driver's files alone (kplrun never loads CUDA).
 *
 * The driver lists its GPUs in sysfs, one directory per PCI address
 * (/sys/bus/pci/drivers/nvidia/0000:3b:00.0, with local_cpulist inside).
 * Sorted, that is CUDA's order under CUDA_DEVICE_ORDER=PCI_BUS_ID, which
 * the agent sets.  CUDA_VISIBLE_DEVICES then picks and reorders: CUDA
 * numbers only the GPUs it names, in the order it names them (so under
 * SLURM's --gpus-per-task=1 every rank's one GPU is its cuda:0).  Its
 * entries, as the CUDA programming guide describes them:
 *   - an index into the PCI order ("2");
 *   - a GPU's UUID as nvidia-smi prints it, or enough of its first
 *     characters to name one GPU ("GPU-8932f937-d72c-...", "GPU-8932f937");
 *     the UUID of each GPU is in /proc/driver/nvidia/gpus/<pci>/information
 *     ("GPU UUID: GPU-...");
 *   - a MIG instance: "MIG-GPU-<uuid>/<gi>/<ci>" names its GPU;
 *     "MIG-<uuid>" (drivers from R470) does not.
 * An entry that names no GPU ends the list: CUDA sees only the GPUs
 * before it ("0,2,-1,1" is 0 and 2; "" or SLURM's "NoDevFiles" is none).
 * Where a UUID cannot be matched because the driver's information files
 * are not readable (some containers), the GPU keeps its place in the
 * order given and its PCI address stays unknown: its rank gets the right
 * number but no CPU binding.
 */
#define _GNU_SOURCE
#include "launcher_impl.h"

#include <ctype.h>
#include <dirent.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define MAX_SYSFS 64

typedef struct {
    char pci[KPL__GPU_PCI]; /* NUL-terminated */
    char uuid[96]; /* "GPU-..." from the driver's information file, or "" */
} sysfs_gpu;

static int by_pci(const void *a, const void *b)
{
    return strcmp(((const sysfs_gpu *)a)->pci, ((const sysfs_gpu *)b)->pci);
}

/* The "GPU UUID:" line of the driver's information file of GPU `pci`. */
static void read_uuid(const char *proc, const char *pci, char *uuid, size_t len)
{
    uuid[0] = 0;
    if (!proc) return;
    char path[4096];
    snprintf(path, sizeof path, "%s/%s/information", proc, pci);
    FILE *f = fopen(path, "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "GPU UUID:", 9)) continue;
        char *v = line + 9;
        while (*v == ' ' || *v == '\t') v++;
        size_t n = strcspn(v, " \t\r\n");
        if (n >= 4 && !strncasecmp(v, "GPU-", 4) && n < len) snprintf(uuid, len, "%.*s", (int)n, v);
        break;
    }
    fclose(f);
}

/* The driver's GPUs, sorted by PCI address; their count. */
static int list_sysfs(const char *sysfs, const char *proc, sysfs_gpu *g, int max)
{
    DIR *d = sysfs ? opendir(sysfs) : NULL;
    if (!d) return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < max) {
        unsigned dom, bus, dev, fn;
        char tail;
        size_t len = strlen(e->d_name);
        if (sscanf(e->d_name, "%x:%x:%x.%x%c", &dom, &bus, &dev, &fn, &tail) != 4 ||
            len >= sizeof g[n].pci)
            continue;
        memcpy(g[n].pci, e->d_name, len + 1);
        n++;
    }
    closedir(d);
    qsort(g, (size_t)n, sizeof *g, by_pci);
    for (int i = 0; i < n; i++) read_uuid(proc, g[i].pci, g[i].uuid, sizeof g[i].uuid);
    return n;
}

static void note_set(char *note, size_t len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void note_set(char *note, size_t len, const char *fmt, ...)
{
    if (!note || !len || note[0]) return; /* the first note is the one that matters */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(note, len, fmt, ap);
    va_end(ap);
}

/* The sysfs GPU whose UUID starts with `uuid` (which starts "GPU-"): its
 * index, -1 when none, -2 when several. */
static int match_uuid(const sysfs_gpu *g, int n, const char *uuid)
{
    int found = -1;
    size_t len = strlen(uuid);
    for (int i = 0; i < n; i++) {
        if (!g[i].uuid[0] || strncasecmp(g[i].uuid, uuid, len)) continue;
        if (found >= 0) return -2;
        found = i;
    }
    return found;
}

/* What one CUDA_VISIBLE_DEVICES entry names: the sysfs index (>= 0), -1
 * for a GPU whose PCI address cannot be known (an unmatched UUID without
 * the driver's UUIDs, a new-style MIG UUID), or -2 when it names no GPU
 * (with why in `why`).  *mig: a MIG instance (several may share a GPU). */
static int entry_gpu(const sysfs_gpu *g, int n, bool have_uuids, const char *e, bool *mig,
                     char *why, size_t wlen)
{
    *mig = !strncasecmp(e, "MIG-", 4);
    if (*e && strspn(e, "0123456789") == strlen(e)) {
        long k = strtol(e, NULL, 10);
        if (strlen(e) <= 4 && k < n) return (int)k;
        snprintf(why, wlen, "index %s, and this node has %d GPU(s)", e, n);
        return -2;
    }
    char gpu_uuid[96];
    if (!strncasecmp(e, "MIG-GPU-", 8)) { /* MIG-GPU-<uuid>/<gi>/<ci>: its GPU's UUID */
        snprintf(gpu_uuid, sizeof gpu_uuid, "%.*s", (int)strcspn(e + 4, "/"), e + 4);
    } else if (!strncasecmp(e, "MIG-", 4)) {
        return -1; /* a MIG instance's own UUID: the driver's files do not say its GPU */
    } else if (!strncasecmp(e, "GPU-", 4)) {
        snprintf(gpu_uuid, sizeof gpu_uuid, "%s", e);
    } else {
        snprintf(why, wlen, "'%s' is neither an index nor a GPU-/MIG- UUID", e);
        return -2;
    }
    if (!have_uuids) return -1;
    int k = match_uuid(g, n, gpu_uuid);
    if (k == -2) snprintf(why, wlen, "'%s' is the start of more than one GPU's UUID", e);
    else if (k < 0) snprintf(why, wlen, "no GPU of this node has UUID %s", gpu_uuid);
    return k < 0 ? -2 : k;
}

int kpl__launcher_visible_gpus(const char *sysfs, const char *proc, const char *visible,
                               kpl__gpu *out, int max, char *note, size_t note_len)
{
    if (note && note_len) note[0] = 0;
    sysfs_gpu g[MAX_SYSFS];
    int n = list_sysfs(sysfs, proc, g, MAX_SYSFS);
    if (!visible) {
        int k = 0;
        for (; k < n && k < max; k++) memcpy(out[k].pci, g[k].pci, sizeof out[k].pci);
        return k;
    }
    bool have_uuids = n > 0;
    for (int i = 0; i < n; i++) have_uuids = have_uuids && g[i].uuid[0];
    bool used[MAX_SYSFS] = {false}, unmapped = false;
    int count = 0;
    char list[1024];
    snprintf(list, sizeof list, "%s", visible);
    char *save = NULL;
    for (char *e = strtok_r(list, ",", &save); e && count < max && count < n;
         e = strtok_r(NULL, ",", &save)) {
        while (isspace((unsigned char)*e)) e++;
        for (size_t l = strlen(e); l > 0 && isspace((unsigned char)e[l - 1]); l--) e[l - 1] = 0;
        char why[160] = "";
        bool mig = false;
        int k = entry_gpu(g, n, have_uuids, e, &mig, why, sizeof why);
        if (k >= 0 && used[k] && !mig) {
            snprintf(why, sizeof why, "'%s' names GPU %s a second time", e, g[k].pci);
            k = -2;
        }
        if (k == -2) {
            note_set(note, note_len, "CUDA_VISIBLE_DEVICES='%s': %s; CUDA sees only the %d "
                     "GPU(s) named before it", visible, why, count);
            break;
        }
        if (k >= 0) used[k] = true;
        else unmapped = true;
        if (k >= 0) memcpy(out[count].pci, g[k].pci, sizeof out[count].pci);
        else out[count].pci[0] = 0;
        count++;
    }
    if (unmapped)
        note_set(note, note_len, "CUDA_VISIBLE_DEVICES='%s' names GPUs by UUIDs that %s: "
                 "ranks on them are numbered in the order given but not bound to their GPU's "
                 "CPUs", visible, have_uuids ? "the driver's files do not list (MIG instances)"
                                             : "cannot be matched (no readable "
                                               "/proc/driver/nvidia/gpus/*/information)");
    return count;
}
