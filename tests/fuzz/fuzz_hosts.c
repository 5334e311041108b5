/*
 * fuzz_hosts.c — kplrun's host lists (launcher/hosts.c): --host specs,
 * hostfiles (Open MPI's and PBS_NODEFILE's form), SLURM's compressed node
 * lists with SLURM_TASKS_PER_NODE, then the mpirun command built from each
 * list that parsed and its shell-quoted form; and kplrun's reading of a
 * rank's timeout report (kpl_launch_parse_timeout, verdict.c), which sees
 * whatever a rank prints.
 *
 * Input: text.  Its first line is given to kpl_hosts_parse and, with the
 * second line as the tasks per node, to kpl_hosts_from_slurm; the whole
 * text is written as a hostfile for kpl_hosts_read_file.  The first line
 * is also the command kplrun would run, so that its quoting is exercised,
 * and every line is a rank's output line for the timeout reader.
 */
#include "fuzz_common.h"

#include "launcher.h"

/* What the reader fills is terminated text within its fields. */
static void read_report(const char *line)
{
    kpl_launch_stall r;
    memset(&r, 0xab, sizeof r);
    if (!kpl_launch_parse_timeout(line, &r)) return;
    if (!memchr(r.op, 0, sizeof r.op) || !memchr(r.ranks, 0, sizeof r.ranks) ||
        !memchr(r.detail, 0, sizeof r.detail) || !r.ranks[0] || r.first < 0)
        abort();
}

static void use(const kpl_hostlist *h, const char *cmd)
{
    int slots = kpl_hosts_slots(h);
    if (h->n < 1 || slots < h->n) abort(); /* every host has >= 1 slot */
    for (int i = 0; i < h->n; i++) {
        size_t len = strlen(h->host[i].name);
        if (len == 0 || len >= KPL_HOST_NAME_MAX || h->host[i].slots < 1) abort();
    }
    kpl_launch_config c = KPL_LAUNCH_CONFIG_INIT;
    c.hosts = h;
    c.np = slots < 4096 ? slots : 4096;
    c.cores_per_node = 2;
    char *const argv[] = {(char *)cmd, "--flag", NULL};
    char **out = NULL;
    if (kpl_launch_mpirun_argv(&c, 2, argv, &out, NULL, NULL) == KPL_OK) {
        char *s = kpl_launch_argv_string(out);
        if (!s) abort();
        free(s);
        kpl_launch_free_argv(out);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_reset();
    char path[PATH_MAX];
    fuzz_path(path, fuzz_dir("hosts"), "hostfile");
    char *text = fuzz_strndup(data, size);
    char *nl = strchr(text, '\n');
    char *line1 = fuzz_strndup(data, nl ? (size_t)(nl - text) : strlen(text));
    char *line2 = NULL;
    if (nl) {
        char *e = strchr(nl + 1, '\n');
        line2 = fuzz_strndup((const uint8_t *)nl + 1, e ? (size_t)(e - nl - 1) : strlen(nl + 1));
    }
    for (char *l = text, *e; l; l = e ? e + 1 : NULL) { /* each line, cut at its end */
        e = strchr(l, '\n');
        if (e) *e = 0;
        read_report(l);
        if (e) *e = '\n';
    }
    kpl_hostlist h = {0};
    if (fuzz_st(kpl_hosts_parse(line1, &h), "parse") == KPL_OK) use(&h, line1);
    kpl_hosts_free(&h);
    if (fuzz_st(kpl_hosts_from_slurm(line1, line2, &h), "slurm") == KPL_OK) use(&h, line1);
    kpl_hosts_free(&h);
    fuzz_write(path, data, size);
    if (fuzz_st(kpl_hosts_read_file(path, &h), "hostfile") == KPL_OK) use(&h, line1);
    kpl_hosts_free(&h);
    unlink(path);
    free(line2);
    free(line1);
    free(text);
    return 0;
}
