/* test_launcher.c — kplrun's host lists (--host, hostfiles, PBS node
 * files, SLURM node lists), the mpirun command it builds, its reading
 * of a rank's collective timeout report, and the GPUs a rank sees under
 * CUDA_VISIBLE_DEVICES (stand-in driver directories in a temp dir). */
#include "kpl_test.h"
#include "launcher.h"
#include "launcher_impl.h"

#include <sys/stat.h>

#include <signal.h>
#include <sys/wait.h>

#include <stdlib.h>
#include <unistd.h>

static void expect_hosts(const kpl_hostlist *l, int n, const char *const *names, const int *slots)
{
    assert_int_equal(l->n, n);
    for (int i = 0; i < n; i++) {
        assert_string_equal(l->host[i].name, names[i]);
        assert_int_equal(l->host[i].slots, slots[i]);
    }
}

static void test_host_spec(void **state)
{
    (void)state;
    kpl_hostlist l;
    OK(kpl_hosts_parse("h1:8,h2:8", &l));
    expect_hosts(&l, 2, (const char *[]){"h1", "h2"}, (int[]){8, 8});
    assert_int_equal(kpl_hosts_slots(&l), 16);
    kpl_hosts_free(&l);
    /* no slots: 1 each; a host named twice adds up, in first-seen order */
    OK(kpl_hosts_parse("b,a:2,b:3,10.0.0.7", &l));
    expect_hosts(&l, 3, (const char *[]){"b", "a", "10.0.0.7"}, (int[]){4, 2, 1});
    kpl_hosts_free(&l);
    FAILS(kpl_hosts_parse("h1:0", &l), KPL_EINVAL, "'h1:0': the slots after ':' must be a number");
    FAILS(kpl_hosts_parse("h1:x", &l), KPL_EINVAL, "'h1:x'");
    FAILS(kpl_hosts_parse("h1,,h2", &l), KPL_EINVAL, "host name '' is empty");
    FAILS(kpl_hosts_parse("h1;rm", &l), KPL_EINVAL, "'h1;rm' has a character");
    FAILS(kpl_hosts_parse("", &l), KPL_EINVAL, "no host in ''");
    assert_null(l.host);
    assert_int_equal(l.n, 0);
}

static char *write_tmp(const char *text)
{
    static char path[64];
    snprintf(path, sizeof path, "/tmp/kpl-hostfile-XXXXXX");
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    return path;
}

static void test_hostfile(void **state)
{
    (void)state;
    kpl_hostlist l;
    /* Open MPI's form, with comments, blank lines and max_slots */
    char *p = write_tmp("# the cluster\n"
                        "node1 slots=8 max_slots=16\n"
                        "\n"
                        "  node2   slots=4   # half of it\n"
                        "node3\n");
    OK(kpl_hosts_read_file(p, &l));
    expect_hosts(&l, 3, (const char *[]){"node1", "node2", "node3"}, (int[]){8, 4, 1});
    kpl_hosts_free(&l);
    unlink(p);
    /* PBS_NODEFILE's: a name per slot */
    p = write_tmp("cn07\ncn07\ncn07\ncn09\ncn07\n");
    OK(kpl_hosts_read_file(p, &l));
    expect_hosts(&l, 2, (const char *[]){"cn07", "cn09"}, (int[]){4, 1});
    kpl_hosts_free(&l);
    unlink(p);
    /* errors name the file and line */
    char want[128];
    p = write_tmp("node1 slots=8\nnode2 slots=eight\n");
    snprintf(want, sizeof want, "hostfile %s:2: 'slots=eight' is not slots=N", p);
    FAILS(kpl_hosts_read_file(p, &l), KPL_EINVAL, want);
    unlink(p);
    p = write_tmp("node1 cpus 4\n");
    snprintf(want, sizeof want, "hostfile %s:1: unexpected 'cpus'", p);
    FAILS(kpl_hosts_read_file(p, &l), KPL_EINVAL, want);
    unlink(p);
    p = write_tmp("# nothing\n\n");
    snprintf(want, sizeof want, "hostfile %s: no host in it", p);
    FAILS(kpl_hosts_read_file(p, &l), KPL_EINVAL, want);
    unlink(p);
    FAILS(kpl_hosts_read_file("/nonexistent/hosts", &l), KPL_EIO,
          "hostfile /nonexistent/hosts: No such file");
}

static void test_slurm(void **state)
{
    (void)state;
    kpl_hostlist l;
    OK(kpl_hosts_from_slurm("node[01-04,07],gpu3", "8(x3),4", &l));
    expect_hosts(&l, 6, (const char *[]){"node01", "node02", "node03", "node04", "node07", "gpu3"},
                 (int[]){8, 8, 8, 4, 4, 4});
    kpl_hosts_free(&l);
    /* SLURM_NTASKS_PER_NODE is one number; none: 1 each */
    OK(kpl_hosts_from_slurm("a[8-11]", "2", &l));
    expect_hosts(&l, 4, (const char *[]){"a8", "a9", "a10", "a11"}, (int[]){2, 2, 2, 2});
    kpl_hosts_free(&l);
    OK(kpl_hosts_from_slurm("single", NULL, &l));
    expect_hosts(&l, 1, (const char *[]){"single"}, (int[]){1});
    kpl_hosts_free(&l);
    /* two bracket groups and a suffix */
    OK(kpl_hosts_from_slurm("r[1-2]n[9-10].ib,x", "1(x2),2,3,5", &l));
    expect_hosts(&l, 5, (const char *[]){"r1n9.ib", "r1n10.ib", "r2n9.ib", "r2n10.ib", "x"},
                 (int[]){1, 1, 2, 3, 5});
    kpl_hosts_free(&l);
    FAILS(kpl_hosts_from_slurm("node[01-", "1", &l), KPL_EINVAL, "'[' without ']'");
    FAILS(kpl_hosts_from_slurm("node[4-2]", "1", &l), KPL_EINVAL, "bad range '4-2'");
    FAILS(kpl_hosts_from_slurm("node[1-2]", "2(y2)", &l), KPL_EINVAL,
          "tasks per node '2(y2)': cannot read '2(y2)'");
    FAILS(kpl_hosts_from_slurm("", "1", &l), KPL_EINVAL, "is empty");
    /* 100,000 names (the fuzzer's slurm-range-quadratic took ~100 s):
     * linear growth and one sorted merge of repeats */
    double t0 = kpl_seconds();
    OK(kpl_hosts_from_slurm("n[0-99999]", "1", &l));
    assert_int_equal(l.n, 100000);
    assert_string_equal(l.host[99999].name, "n99999");
    assert_true(kpl_seconds() - t0 < 5);
    kpl_hosts_free(&l);
    /* nested ranges that spell 10^10 names stop at the limit at once */
    FAILS(kpl_hosts_from_slurm("a[0-99999]b[0-99999]", "1", &l), KPL_EINVAL,
          "SLURM node list 'a[0-99999]b[0-99999]': more than 131072 host names");
    /* an empty bracket spells no name after walking every combination of
     * the others (the fuzzer's slurm-empty-range-product never ended) */
    t0 = kpl_seconds();
    FAILS(kpl_hosts_from_slurm("a[0-99999]b[0-99999][]", "1", &l), KPL_EINVAL,
          "more than 131072 host names");
    FAILS(kpl_hosts_from_slurm("a[0-9]b[]", "1", &l), KPL_EINVAL, "empty brackets '[]'");
    FAILS(kpl_hosts_from_slurm("a[0-9]b[0-99999]c[0-1]", "1", &l), KPL_EINVAL,
          "more than 131072 host names");
    assert_true(kpl_seconds() - t0 < 1);
    /* repeats add their slots to the first place, in first-place order */
    OK(kpl_hosts_from_slurm("b,a[1-2],b,a1", "2,3,4,5,6", &l));
    assert_int_equal(l.n, 3);
    assert_string_equal(l.host[0].name, "b");
    assert_int_equal(l.host[0].slots, 2 + 5);
    assert_string_equal(l.host[1].name, "a1");
    assert_int_equal(l.host[1].slots, 3 + 6);
    assert_string_equal(l.host[2].name, "a2");
    assert_int_equal(l.host[2].slots, 4);
    kpl_hosts_free(&l);
    FAILS(kpl_hosts_parse("x:1048576,x:1", &l), KPL_EINVAL, "host 'x' adds up to more than");
}

/* Index of `arg` in argv, or -1; and the value after it. */
static int find(char **argv, const char *arg)
{
    for (int i = 0; argv[i]; i++)
        if (!strcmp(argv[i], arg)) return i;
    return -1;
}

static void test_mpirun_argv(void **state)
{
    (void)state;
    char *cmd[] = {"kpl", "train", "a b.yaml", NULL};
    char **a = NULL;
    int per = 0, threads = 0;

    /* one 16-core box, 4 ranks: 4 cores each, bound */
    kpl_launch_config c = KPL_LAUNCH_CONFIG_INIT;
    c.np = 4;
    c.cores_per_node = 16;
    c.agent = "/opt/kpl/bin/kplrun";
    c.log_dir = "logs";
    unsetenv("OMP_NUM_THREADS");
    OK(kpl_launch_mpirun_argv(&c, 3, cmd, &a, &per, &threads));
    char *s = kpl_launch_argv_string(a);
    assert_string_equal(s, "mpirun -np 4 --map-by slot:PE=4 --bind-to core -x OMP_NUM_THREADS=4 "
                           "--mca mpi_yield_when_idle 1 /opt/kpl/bin/kplrun --agent --log-dir logs -- kpl train 'a b.yaml'");
    assert_int_equal(per, 4);
    assert_int_equal(threads, 4);
    free(s);
    kpl_launch_free_argv(a);

    /* more ranks than cores, as root, UCX, a bar: oversubscribed, unbound */
    c.np = 6;
    c.cores_per_node = 2;
    c.as_root = true;
    c.ucx = true;
    c.bar = true;
    c.columns = 120;
    OK(kpl_launch_mpirun_argv(&c, 3, cmd, &a, &per, &threads));
    s = kpl_launch_argv_string(a);
    assert_string_equal(s, "mpirun -np 6 --allow-run-as-root --oversubscribe --bind-to none "
                           "-x OMP_NUM_THREADS=1 --mca pml ucx --mca pml_ucx_tls any --mca "
                           "pml_ucx_devices any --mca mpi_yield_when_idle 1 /opt/kpl/bin/kplrun --agent --log-dir logs --bar "
                           "--columns 120 -- kpl train 'a b.yaml'");
    assert_int_equal(threads, 1);
    free(s);
    kpl_launch_free_argv(a);

    /* two 8-GPU nodes of 64 cores: one rank per GPU, 8 threads each, the
     * user's extra options before the agent */
    kpl_hostlist h;
    OK(kpl_hosts_parse("g1:8,g2:8", &h));
    kpl_launch_config g = KPL_LAUNCH_CONFIG_INIT;
    g.np = 16;
    g.hosts = &h;
    g.cores_per_node = 64;
    g.gpus_per_node = 8;
    g.agent = "kplrun";
    const char *extra[] = {"-x", "NCCL_DEBUG", "--mca", "btl_tcp_if_include", "ib0"};
    g.nextra = 5;
    g.extra = extra;
    OK(kpl_launch_mpirun_argv(&g, 2, cmd, &a, &per, &threads));
    s = kpl_launch_argv_string(a);
    assert_string_equal(s, "mpirun -np 16 --host g1:8,g2:8 --map-by ppr:8:node --bind-to none "
                           "-x OMP_NUM_THREADS=8 --mca mpi_yield_when_idle 1 --mca "
                           "oob_tcp_keepalive_time 10 --mca "
                           "oob_tcp_keepalive_intvl 2 --mca oob_tcp_keepalive_probes 3 -x "
                           "NCCL_DEBUG --mca btl_tcp_if_include ib0 kplrun --agent --log-dir kplrun-logs -- kpl train");
    assert_int_equal(per, 8);
    assert_int_equal(threads, 8);
    free(s);
    kpl_launch_free_argv(a);

    /* a hostfile is passed through; the user's OMP_NUM_THREADS is kept */
    g.hosts = &h;
    g.hostfile = "my hosts";
    g.nextra = 0;
    setenv("OMP_NUM_THREADS", "3", 1);
    OK(kpl_launch_mpirun_argv(&g, 2, cmd, &a, NULL, NULL));
    assert_string_equal(a[find(a, "--hostfile") + 1], "my hosts");
    assert_int_equal(find(a, "--host"), -1);
    assert_string_equal(a[find(a, "-x") + 1], "OMP_NUM_THREADS");
    unsetenv("OMP_NUM_THREADS");
    kpl_launch_free_argv(a);
    kpl_hosts_free(&h);

    /* more ranks than the hosts' slots: oversubscribe */
    OK(kpl_hosts_parse("n1:2,n2:2", &h));
    kpl_launch_config o = KPL_LAUNCH_CONFIG_INIT;
    o.np = 6;
    o.hosts = &h;
    o.cores_per_node = 8;
    OK(kpl_launch_mpirun_argv(&o, 1, cmd, &a, &per, &threads));
    assert_true(find(a, "--oversubscribe") > 0);
    assert_int_equal(per, 3);
    assert_string_equal(a[find(a, "--map-by") + 1], "slot:PE=2");
    kpl_launch_free_argv(a);
    kpl_hosts_free(&h);

    /* the job's name always; which launch, only when kplrun restarts (the
     * agent puts them in the rank's environment on every node) */
    kpl_launch_config rs = KPL_LAUNCH_CONFIG_INIT;
    rs.agent = "kplrun";
    rs.cores_per_node = 1;
    rs.job_id = "20261126-101500-42";
    OK(kpl_launch_mpirun_argv(&rs, 1, cmd, &a, NULL, NULL));
    s = kpl_launch_argv_string(a);
    assert_non_null(strstr(s, "kplrun --agent --log-dir kplrun-logs --job-id 20261126-101500-42 -- kpl"));
    assert_int_equal(find(a, "--restart"), -1);
    free(s);
    kpl_launch_free_argv(a);
    rs.restart = 2;
    rs.max_restarts = 3;
    rs.restart_reason = "rank 1 on host n7 exited with status 3";
    OK(kpl_launch_mpirun_argv(&rs, 1, cmd, &a, NULL, NULL));
    s = kpl_launch_argv_string(a);
    assert_non_null(strstr(s, "--job-id 20261126-101500-42 --restart 2 --max-restarts 3 "
                              "--restart-reason 'rank 1 on host n7 exited with status 3' -- kpl"));
    free(s);
    kpl_launch_free_argv(a);

    /* shell quoting of the odd ones */
    char *odd[] = {"it's", "", "$HOME", "a=b,c:d", NULL};
    s = kpl_launch_argv_string(odd);
    assert_string_equal(s, "'it'\\''s' '' '$HOME' a=b,c:d");
    free(s);

    o.np = 0;
    FAILS(kpl_launch_mpirun_argv(&o, 1, cmd, &a, NULL, NULL), KPL_EINVAL, "-np 0 must be >= 1");
    o.np = 1;
    FAILS(kpl_launch_mpirun_argv(&o, 0, cmd, &a, NULL, NULL), KPL_EINVAL, "no command");
}

/* The lines are the communicator's reports (collective/watchdog.c) as
 * kplrun receives them, or as a program passes kpl_last_error() on. */
static void test_timeout_report(void **state)
{
    (void)state;
    kpl_launch_stall s;
    /* one rank stopped: as the kplrun_stall test's rank 0 prints it */
    assert_true(kpl_launch_parse_timeout(
        "[r0] kpl[0] comm: allgather #1 (u8, 128 elements) on backend mpi, rank 0 of 2: timed "
        "out after 3 s; not joined: rank 1: no answer for 4.1 s (stopped or hung?); joined: rank "
        "0; the ranks are out of step: end the job (kpl_comm_abort)",
        &s));
    assert_string_equal(s.op, "allgather #1");
    assert_string_equal(s.ranks, "1");
    assert_int_equal(s.first, 1);
    assert_false(s.plural);
    assert_false(s.device);
    assert_string_equal(s.detail, "rank 1: no answer for 4.1 s (stopped or hung?)");

    /* several ranks in each of the ways; the op is the one that timed out,
     * not the different collective another rank is in */
    assert_true(kpl_launch_parse_timeout(
        "[r0] kpl[0] comm: allreduce #7 (f32, 10 elements) on backend mpi, rank 0 of 6: timed out "
        "after 300 s; not joined: rank 2 is idle, 301.5 s after finishing #6; rank 3 is in "
        "broadcast #7 for 300.2 s (a different collective at the same place: the ranks issued "
        "different sequences); ranks 4-5: no answer for 302.0 s (stopped or hung?); joined: ranks "
        "0-1; the ranks are out of step: end the job (kpl_comm_abort)",
        &s));
    assert_string_equal(s.op, "allreduce #7");
    assert_string_equal(s.ranks, "2, 3, 4-5");
    assert_int_equal(s.first, 2);
    assert_true(s.plural);
    assert_string_equal(s.detail,
                        "rank 2 is idle, 301.5 s after finishing #6; rank 3 is in broadcast #7 "
                        "for 300.2 s (a different collective at the same place: the ranks issued "
                        "different sequences); ranks 4-5: no answer for 302.0 s (stopped or hung?)");

    /* as an error message passed on (ucx's own words and the source
     * location after it), from rank 1 waiting for rank 0 */
    assert_true(kpl_launch_parse_timeout(
        "[r1] kpl train: error: reduce_scatter #12 (f32, 4 elements) on backend ucx, rank 1 of 2: "
        "timed out after 5 s; not joined: rank 0 is idle, 5.1 s after finishing #11; joined: "
        "rank 1; the ranks are out of step: end the job (kpl_comm_abort) (ucx: reduce_scatter "
        "#12: no data from rank 0 at the deadline) [collective/comm.c:400]",
        &s));
    assert_string_equal(s.op, "reduce_scatter #12");
    assert_string_equal(s.ranks, "0");
    assert_int_equal(s.first, 0);
    assert_string_equal(s.detail, "rank 0 is idle, 5.1 s after finishing #11");

    /* a device collective: the ranks that have not issued it */
    assert_true(kpl_launch_parse_timeout(
        "kpl[0] comm: barrier #3 on backend nccl, rank 0 of 4: timed out after 300 s on the "
        "device; not issued yet by ranks 2-3; not answering: rank 1: no answer for 302.0 s "
        "(stopped or hung?); the ranks are out of step: end the job (kpl_comm_abort)",
        &s));
    assert_string_equal(s.op, "barrier #3");
    assert_string_equal(s.ranks, "2-3");
    assert_int_equal(s.first, 2);
    assert_true(s.plural);
    assert_true(s.device);

    /* a line cut short still names what it has */
    assert_true(kpl_launch_parse_timeout(
        "kpl[0] comm: allreduce #2 (f32, 1 elements) on backend mpi, rank 0 of 16: timed out "
        "after 3 s; not joined: rank 12",
        &s));
    assert_string_equal(s.ranks, "12");
    assert_int_equal(s.first, 12);

    /* and no verdict from anything else */
    const char *no[] = {
        /* the stall warning: nobody has timed out yet */
        "[r0] kpl[0] comm: stall: allgather #1 (u8, 128 elements) on backend mpi, rank 0 of 2 has "
        "waited 1.1 s; not joined: rank 1: no answer for 2.0 s (stopped or hung?); joined: rank 0",
        /* everybody joined: a network fault, nobody to name */
        "kpl[0] comm: allreduce #1 (f32, 4 elements) on backend mpi, rank 0 of 2: timed out after "
        "3 s; not joined: none; joined: ranks 0-1; the ranks are out of step",
        /* point to point: no collective */
        "kpl[0] comm: recv from rank 1 (tag 3, f32, 4 elements) on backend mpi, rank 0 of 2: timed "
        "out after 3 s; rank 1: no answer for 4.0 s (stopped or hung?)",
        /* cut before a rank, or after "rank" */
        "kpl[0] comm: allreduce #2 (f32, 1 elements) on backend mpi, rank 0 of 16: timed out after "
        "3 s; not joined: ",
        "kpl[0] comm: allreduce #2 (f32, 1 elements) on backend mpi, rank 0 of 16: timed out after "
        "3 s; not joined: rank",
        "kpl[0] comm: allreduce #2 (f32, 1 elements) on backend mpi, rank 0 of 16: timed out after "
        "3 s; not joined: ranks ; joined: rank 0",
        /* a user's line that looks a little like one */
        "[r0] the myallreduce #3 call timed out after 3 s; not joined: rank 1",
        "[r0] allreduce #x: timed out after 3 s; not joined: rank 1",
        "step 10: loss 0.25, timed out after 3 s; not joined: rank 1",
        "",
        /* no rank has such a number (the fuzzer's: first came out -1) */
        "comm: allgather #6: timed out after 300 s; not joined: rank 099999999993 00 s; );1",
        "comm: allgather #6: timed out after 300 s; not joined: rank 2; rank 1073741824",
    };
    for (size_t i = 0; i < sizeof no / sizeof *no; i++) {
        assert_false(kpl_launch_parse_timeout(no[i], &s));
    }
    assert_false(kpl_launch_parse_timeout(NULL, &s));
}

/* kplrun's verdict from the ranks' ends: whom to blame and the exit status. */
static void test_verdict(void **state)
{
    (void)state;
    kpl_launch_end e[3];
    kpl_launch_verdict v;
    memset(e, 0, sizeof e);
#define END(r, st, sg, t) (e[r].seen = true, e[r].status = (st), e[r].sig = (sg), e[r].at = (t))
    /* every rank ended well */
    END(0, 0, 0, 1), END(1, 0, 0, 1), END(2, 0, 0, 1);
    kpl_launch_judge(e, 3, -1, 0, 0, W_EXITCODE(0, 0), false, 0, 0, false, &v);
    assert_int_equal(v.kind, KPL_VERDICT_OK);
    assert_int_equal(v.exit_code, 0);
    /* rank 1 failed with status 3; rank 0, torn down by SIGTERM, was first
     * to end but is not the one to blame */
    END(0, 0, SIGTERM, 2), END(1, 3, 0, 5), END(2, 143, 0, 6);
    kpl_launch_judge(e, 3, -1, 0, 0, W_EXITCODE(3, 0), false, 0, 0, false, &v);
    assert_int_equal(v.kind, KPL_VERDICT_RANK);
    assert_int_equal(v.rank, 1);
    assert_int_equal(v.status, 3);
    assert_false(v.from_mpirun);
    assert_false(v.interrupted);
    assert_int_equal(v.exit_code, 3);
    /* two failures: the earlier one; a killed rank gives 128 + signal */
    END(0, 0, SIGKILL, 2), END(1, 1, 0, 3), END(2, 0, 0, 4);
    kpl_launch_judge(e, 3, -1, 0, 0, W_EXITCODE(1, 0), false, 0, 0, false, &v);
    assert_int_equal(v.rank, 0);
    assert_int_equal(v.sig, SIGKILL);
    assert_int_equal(v.exit_code, 128 + SIGKILL);
    /* only SIGTERMs: the first of them */
    END(0, 0, SIGTERM, 7), END(1, 0, SIGTERM, 3), END(2, 0, 0, 4);
    kpl_launch_judge(e, 3, -1, 0, 0, W_EXITCODE(1, 0), false, 0, 0, false, &v);
    assert_int_equal(v.rank, 1);
    assert_int_equal(v.exit_code, 128 + SIGTERM);
    /* ... unless mpirun's notice names a rank whose agent could not speak */
    kpl_launch_judge(e, 3, 2, 0, SIGKILL, W_EXITCODE(1, 0), false, 0, 0, false, &v);
    assert_int_equal(v.rank, 2);
    assert_true(v.from_mpirun);
    assert_int_equal(v.exit_code, 128 + SIGKILL);
    /* the user's Ctrl-C explains a rank that ended with 130 */
    END(0, 130, 0, 1), END(1, 0, 0, 1), END(2, 0, 0, 1);
    kpl_launch_judge(e, 3, -1, 0, 0, W_EXITCODE(130, 0), false, 1, 0, false, &v);
    assert_int_equal(v.rank, 0);
    assert_true(v.interrupted);
    assert_int_equal(v.exit_code, 130);
    /* every rank stopped on SIGTERM (exit 143): a stop, whoever sent it */
    END(0, 143, 0, 1), END(1, 143, 0, 2), END(2, 143, 0, 1);
    kpl_launch_judge(e, 3, -1, 0, 0, W_EXITCODE(143, 0), false, 1, 0, false, &v);
    assert_int_equal(v.kind, KPL_VERDICT_STOPPED);
    assert_int_equal(v.status, 143);
    assert_true(v.interrupted);
    assert_int_equal(v.exit_code, 143);
    kpl_launch_judge(e, 3, -1, 0, 0, W_EXITCODE(143, 0), false, 0, 0, false, &v);
    assert_int_equal(v.kind, KPL_VERDICT_STOPPED);
    assert_false(v.interrupted);
    /* ... not when one rank was killed, ended otherwise or said nothing */
    END(2, 0, SIGTERM, 1);
    kpl_launch_judge(e, 3, -1, 0, 0, W_EXITCODE(143, 0), false, 1, 0, false, &v);
    assert_int_equal(v.kind, KPL_VERDICT_RANK);
    END(2, 130, 0, 1);
    kpl_launch_judge(e, 3, -1, 0, 0, W_EXITCODE(143, 0), false, 1, 0, false, &v);
    assert_int_equal(v.kind, KPL_VERDICT_RANK);
    e[2].seen = false;
    kpl_launch_judge(e, 3, -1, 0, 0, W_EXITCODE(143, 0), false, 1, 0, false, &v);
    assert_int_equal(v.kind, KPL_VERDICT_RANK);
    /* asked to stop (SIGTERM), then killed hard: the ranks that said
     * nothing, or ended by the stop's signals, were kplrun's doing, not a
     * failure of mpirun's; 128 + SIGTERM */
    memset(e, 0, sizeof e);
    END(1, 0, SIGKILL, 3);
    kpl_launch_judge(e, 3, 0, 0, SIGKILL, W_EXITCODE(1, 0), false, 2, SIGTERM, true, &v);
    assert_int_equal(v.kind, KPL_VERDICT_KILLED);
    assert_int_equal(v.sig, SIGTERM);
    assert_int_equal(v.exit_code, 128 + SIGTERM);
    /* ... but a rank that failed on its own is still named */
    END(2, 3, 0, 2);
    kpl_launch_judge(e, 3, 0, 0, SIGKILL, W_EXITCODE(1, 0), false, 2, SIGTERM, true, &v);
    assert_int_equal(v.kind, KPL_VERDICT_RANK);
    assert_int_equal(v.rank, 2);
    /* ... or the signal reached mpirun too (a scheduler's stop of every
     * process), which ended before the ranks said how they ended */
    memset(e, 0, sizeof e);
    END(0, 143, 0, 1);
    kpl_launch_judge(e, 3, -1, 0, 0, W_EXITCODE(1, 0), false, 1, SIGTERM, false, &v);
    assert_int_equal(v.kind, KPL_VERDICT_KILLED);
    assert_false(v.hard);
    assert_int_equal(v.missing, 2);
    assert_int_equal(v.exit_code, 128 + SIGTERM);
    /* without a stop asked for, silence is mpirun's to explain */
    memset(e, 0, sizeof e);
    kpl_launch_judge(e, 3, -1, 0, 0, W_EXITCODE(1, 0), false, 0, 0, false, &v);
    assert_int_equal(v.kind, KPL_VERDICT_MPIRUN);
    END(0, 130, 0, 1), END(1, 0, 0, 1), END(2, 0, 0, 1);
    /* --timeout wins over everything: 124 */
    kpl_launch_judge(e, 3, -1, 0, 0, W_EXITCODE(0, SIGTERM), true, 0, 0, false, &v);
    assert_int_equal(v.kind, KPL_VERDICT_TIMEOUT);
    assert_int_equal(v.exit_code, 124);
    /* no agent said a word and mpirun failed: mpirun's status */
    memset(e, 0, sizeof e);
    kpl_launch_judge(e, 3, -1, 0, 0, W_EXITCODE(1, 0), false, 0, 0, false, &v);
    assert_int_equal(v.kind, KPL_VERDICT_MPIRUN);
    assert_int_equal(v.missing, 3);
    assert_int_equal(v.exit_code, 1);
    /* mpirun ended well but a rank ended without a word */
    END(0, 0, 0, 1), END(1, 0, 0, 1);
    kpl_launch_judge(e, 3, -1, 0, 0, W_EXITCODE(0, 0), false, 0, 0, false, &v);
    assert_int_equal(v.kind, KPL_VERDICT_SILENT);
    assert_int_equal(v.missing, 1);
    assert_int_equal(v.exit_code, 1);
#undef END
}

/* ---- the GPUs a rank sees ---- */

static char gpu_root[64];

/* A stand-in for the driver's sysfs directory (three GPUs, listed out of
 * PCI order, among the driver's other entries) and, with uuids, its
 * /proc/driver/nvidia/gpus information files. */
static void make_driver_tree(void)
{
    snprintf(gpu_root, sizeof gpu_root, "/tmp/kpl-gpus-XXXXXX");
    assert_non_null(mkdtemp(gpu_root));
    static const char *const pci[3] = {"0000:86:00.0", "0000:1a:00.0", "0000:3b:00.0"};
    static const char *const uuid[3] = {"GPU-cccc2222-9f4e-4f5b-8b0a-1c2d3e4f5a6b",
                                        "GPU-aaaa1111-0d1e-4c2b-9a8f-7e6d5c4b3a29",
                                        "GPU-aaab3333-5e6f-4a1b-8c9d-0e1f2a3b4c5d"};
    char path[256];
    snprintf(path, sizeof path, "%s/sys", gpu_root);
    assert_int_equal(mkdir(path, 0755), 0);
    snprintf(path, sizeof path, "%s/proc", gpu_root);
    assert_int_equal(mkdir(path, 0755), 0);
    snprintf(path, sizeof path, "%s/sys/module", gpu_root); /* not a GPU */
    assert_int_equal(mkdir(path, 0755), 0);
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s/sys/%s", gpu_root, pci[i]);
        assert_int_equal(mkdir(path, 0755), 0);
        snprintf(path, sizeof path, "%s/proc/%s", gpu_root, pci[i]);
        assert_int_equal(mkdir(path, 0755), 0);
        char text[512], file[512];
        snprintf(text, sizeof text,
                 "Model: \t\t NVIDIA A100-SXM4-80GB\nIRQ:   \t\t 183\nGPU UUID: \t %s\n"
                 "Video BIOS: \t 92.00.45.00.05\nBus Type: \t PCIe\nBus Location: \t %s\n",
                 uuid[i], pci[i]);
        kpl_test_write(path, "information", text, file, sizeof file);
    }
    char f[512];
    snprintf(path, sizeof path, "%s/sys", gpu_root);
    kpl_test_write(path, "new_id", "", f, sizeof f);
}

/* visible -> the PCI addresses CUDA numbers 0, 1, ... ("?" unknown),
 * space-separated, and the note. */
static int gpus_of(const char *visible, bool with_uuids, char *got, size_t len, char *note,
                   size_t nlen)
{
    char sys[128], proc[128];
    snprintf(sys, sizeof sys, "%s/sys", gpu_root);
    snprintf(proc, sizeof proc, "%s/proc", gpu_root);
    kpl__gpu g[8];
    int n = kpl__launcher_visible_gpus(sys, with_uuids ? proc : NULL, visible, g, 8, note, nlen);
    got[0] = 0;
    for (int k = 0; k < n; k++) {
        size_t at = strlen(got);
        snprintf(got + at, len - at, "%s%s", k ? " " : "", g[k].pci[0] ? g[k].pci : "?");
    }
    return n;
}

#define EXPECT_GPUS(visible, uuids, want, note_has)                                         \
    do {                                                                                    \
        char got_[256], note_[1200];                                                        \
        gpus_of((visible), (uuids), got_, sizeof got_, note_, sizeof note_);                \
        if (strcmp(got_, (want)))                                                           \
            fail_msg("CUDA_VISIBLE_DEVICES=%s: GPUs '%s', want '%s'", (visible) ? (visible) \
                     : "(unset)", got_, (want));                                            \
        if (!(note_has)[0] ? note_[0] != 0 : !strstr(note_, (note_has)))                    \
            fail_msg("CUDA_VISIBLE_DEVICES=%s: note '%s', want '%s'", (visible) ? (visible) \
                     : "(unset)", note_, (note_has));                                       \
    } while (0)

static void test_visible_gpus(void **state)
{
    (void)state;
    make_driver_tree();
    const char *a = "0000:1a:00.0", *b = "0000:3b:00.0", *c = "0000:86:00.0";
    char all[64], ca[32], b_only[32];
    snprintf(all, sizeof all, "%s %s %s", a, b, c);
    snprintf(ca, sizeof ca, "%s %s", c, a);
    snprintf(b_only, sizeof b_only, "%s", b);
    /* unset: every GPU, in PCI order */
    EXPECT_GPUS(NULL, true, all, "");
    EXPECT_GPUS(NULL, false, all, "");
    /* indices pick and reorder; SLURM --gpus-per-task=1 gives each rank one */
    EXPECT_GPUS("2,0", true, ca, "");
    EXPECT_GPUS("1", true, b_only, "");
    EXPECT_GPUS(" 2 , 0 ", true, ca, "");
    /* hidden: none, as CUDA; SLURM's placeholder names none either */
    EXPECT_GPUS("", true, "", "");
    EXPECT_GPUS("NoDevFiles", true, "", "'NoDevFiles' is neither an index nor a GPU-/MIG- UUID");
    /* an entry that names no GPU ends the list there */
    EXPECT_GPUS("2,0,-1,1", true, ca, "CUDA sees only the 2 GPU(s) named before it");
    EXPECT_GPUS("1,7", true, b_only, "index 7, and this node has 3 GPU(s)");
    EXPECT_GPUS("1,1,0", true, b_only, "'1' names GPU 0000:3b:00.0 a second time");
    /* UUIDs, whole or a unique start, mapped through the driver's files */
    EXPECT_GPUS("GPU-cccc2222-9f4e-4f5b-8b0a-1c2d3e4f5a6b,GPU-aaaa1111", true, ca, "");
    EXPECT_GPUS("GPU-AAAB", true, b_only, "");
    EXPECT_GPUS("GPU-aaa", true, "", "'GPU-aaa' is the start of more than one GPU's UUID");
    EXPECT_GPUS("GPU-ffff", true, "", "no GPU of this node has UUID GPU-ffff");
    EXPECT_GPUS("2,GPU-aaaa1111", true, ca, "");
    /* MIG: the old form names its GPU, the new one cannot be placed */
    EXPECT_GPUS("MIG-GPU-aaab3333-5e6f-4a1b-8c9d-0e1f2a3b4c5d/1/0", true, b_only, "");
    EXPECT_GPUS("MIG-5f3c0a9e-1d2b-5c4a-9e8f-7a6b5c4d3e2f", true, "?",
                "the driver's files do not list (MIG instances)");
    /* no readable information files: UUIDs keep the order given, unplaced */
    EXPECT_GPUS("GPU-aaab3333,GPU-cccc2222", false, "? ?",
                "cannot be matched (no readable /proc/driver/nvidia/gpus/*/information)");
    EXPECT_GPUS("1,0", false, "0000:3b:00.0 0000:1a:00.0", "");
    /* no driver directory: no GPU, whatever is visible */
    kpl__gpu g[4];
    char note[256];
    assert_int_equal(kpl__launcher_visible_gpus("/nonexistent/nvidia", NULL, "0,1", g, 4, note,
                                                sizeof note), 0);
    assert_int_equal(kpl__launcher_visible_gpus("/nonexistent/nvidia", NULL, NULL, g, 4, NULL, 0),
                     0);
    /* at most max */
    char sys[128];
    snprintf(sys, sizeof sys, "%s/sys", gpu_root);
    assert_int_equal(kpl__launcher_visible_gpus(sys, NULL, NULL, g, 2, NULL, 0), 2);
    assert_string_equal(g[1].pci, b);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", gpu_root);
    assert_int_equal(system(cmd), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_host_spec),
        cmocka_unit_test(test_hostfile),
        cmocka_unit_test(test_slurm),
        cmocka_unit_test(test_mpirun_argv),
        cmocka_unit_test(test_timeout_report),
        cmocka_unit_test(test_verdict),
        cmocka_unit_test(test_visible_gpus),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
