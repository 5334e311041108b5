/* test_writer_lock.c — writers that must not lose each other's files: the
 * WRITING marker's lock tells a live writer (in another process) from a dead
 * one; a dead one's leftovers are removed, a live one's never; an abandoned
 * writer removes only files that are still its own; conversions into one
 * directory take turns through kpl_convert_lock. */
#define KPL_TEST_NAME "wlock"
#include "dataio_test.h"

#include "dataio.h"

#include <errno.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static const kpl_feature_spec schema[1] = {{.name = "x", .type = KPL_FEATURE_INT64}};

static void add_one(kpl_record_writer *w, int64_t v)
{
    kpl_feature_value fv = {&v, 1};
    OK(kpl_record_writer_add(w, &fv));
}

static bool exists(const char *p) { return access(p, F_OK) == 0; }

/* A child process that takes something (`take` succeeds) in `dir`, says so
 * on a pipe and then holds it until it is killed. */
static pid_t child_holding(bool (*take)(const char *dir), const char *dir)
{
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(fds[0]);
        char ok = take(dir) ? 'y' : 'n';
        if (write(fds[1], &ok, 1) != 1) _exit(3);
        for (;;) pause();
    }
    close(fds[1]);
    char c = 0;
    assert_int_equal(read(fds[0], &c, 1), 1);
    close(fds[0]);
    assert_int_equal(c, 'y');
    return pid;
}

/* a writer with one record added */
static bool take_writer(const char *dir)
{
    kpl_record_writer *w = NULL;
    if (kpl_record_writer_create(dir, 1, schema, NULL, &w) != KPL_OK) return false;
    add_one(w, 7);
    return true;
}

static bool take_convert_lock(const char *dir)
{
    int fd = -1;
    return kpl_convert_lock(dir, NULL, NULL, &fd) == KPL_OK;
}

static void kill_child(pid_t pid)
{
    kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
}

static void test_states(void **state)
{
    (void)state;
    kpl_writer_state ws = KPL_WRITER_DEAD;
    char who[300];
    /* no directory, and a finished dataset: no writer */
    OK(kpl_dataset_writer_state(tmp_path("nothing"), &ws, who, sizeof who));
    assert_int_equal(ws, KPL_WRITER_NONE);
    kpl_record_writer *w = NULL;
    OK(kpl_record_writer_create(tmp_path("done"), 1, schema, NULL, &w));
    add_one(w, 1);
    OK(kpl_record_writer_close(w));
    OK(kpl_dataset_writer_state(tmp_path("done"), &ws, who, sizeof who));
    assert_int_equal(ws, KPL_WRITER_NONE);
    FAILS(kpl_dataset_remove_unfinished(tmp_path("done")), KPL_ENOTFOUND, "no WRITING marker");

    /* a writer alive in another process: named, and never removed */
    pid_t pid = child_holding(take_writer, tmp_path("live"));
    OK(kpl_dataset_writer_state(tmp_path("live"), &ws, who, sizeof who));
    assert_int_equal(ws, KPL_WRITER_ALIVE);
    char pidword[32];
    snprintf(pidword, sizeof pidword, "pid %d ", (int)pid);
    assert_non_null(strstr(who, pidword));
    FAILS(kpl_dataset_remove_unfinished(tmp_path("live")), KPL_ESTATE, "is being written right now");
    assert_true(exists(tmp_path("live/00000.data")));
    assert_true(exists(tmp_path("live/WRITING")));
    kpl_dataset *ds = NULL;
    FAILS(kpl_dataset_open(tmp_path("live"), &ds), KPL_EFORMAT, "live");

    /* killed: dead, and its files go with the directory */
    kill_child(pid);
    OK(kpl_dataset_writer_state(tmp_path("live"), &ws, who, sizeof who));
    assert_int_equal(ws, KPL_WRITER_DEAD);
    OK(kpl_dataset_remove_unfinished(tmp_path("live")));
    assert_false(exists(tmp_path("live")));
}

static void test_legacy_marker(void **state)
{
    (void)state;
    /* A marker of a kpl without the lock: judged by its pid on this host. */
    char host[128] = "";
    gethostname(host, sizeof host - 1);
    assert_int_equal(mkdir(tmp_path("old"), 0755), 0);
    FILE *f = fopen(tmp_path("old/WRITING"), "w");
    assert_non_null(f);
    fprintf(f, "pid %d host %s started 2026-01-01T00:00:00Z\n", (int)getpid(), host);
    fclose(f);
    kpl_writer_state ws;
    OK(kpl_dataset_writer_state(tmp_path("old"), &ws, NULL, 0));
    assert_int_equal(ws, KPL_WRITER_ALIVE);
    pid_t gone = fork();
    if (gone == 0) _exit(0);
    waitpid(gone, NULL, 0);
    f = fopen(tmp_path("old/WRITING"), "w");
    fprintf(f, "pid %d host %s started 2026-01-01T00:00:00Z\n", (int)gone, host);
    fclose(f);
    OK(kpl_dataset_writer_state(tmp_path("old"), &ws, NULL, 0));
    assert_int_equal(ws, KPL_WRITER_DEAD);
    /* a file no writer makes keeps the whole folder */
    f = fopen(tmp_path("old/notes.txt"), "w");
    fclose(f);
    FAILS(kpl_dataset_remove_unfinished(tmp_path("old")), KPL_ESTATE, "notes.txt");
    assert_true(exists(tmp_path("old/WRITING")));
    unlink(tmp_path("old/notes.txt"));
    OK(kpl_dataset_remove_unfinished(tmp_path("old")));
    assert_false(exists(tmp_path("old")));
}

static void test_abandon_keeps_others_files(void **state)
{
    (void)state;
    /* w1's directory is emptied behind its back and w2 writes there: when w1
     * gives up, w2's files of the same names stay. */
    kpl_record_writer *w1 = NULL, *w2 = NULL;
    OK(kpl_record_writer_create(tmp_path("race"), 1, schema, NULL, &w1));
    add_one(w1, 1);
    assert_int_equal(unlink(tmp_path("race/00000.data")), 0);
    assert_int_equal(unlink(tmp_path("race/WRITING")), 0);
    OK(kpl_record_writer_create(tmp_path("race"), 1, schema, NULL, &w2));
    add_one(w2, 2);
    kpl_record_writer_destroy(w1);
    assert_true(exists(tmp_path("race/00000.data")));
    assert_true(exists(tmp_path("race/WRITING")));
    OK(kpl_record_writer_close(w2));
    kpl_dataset *ds = NULL;
    OK(kpl_dataset_open(tmp_path("race"), &ds));
    assert_int_equal(kpl_dataset_num_examples(ds), 1);
    kpl_dataset_close(ds);
}

static int calls;
static bool give_up_third(const char *lock, double waited, void *ctx)
{
    (void)lock, (void)waited, (void)ctx;
    return ++calls < 3;
}

static void test_convert_lock(void **state)
{
    (void)state;
    pid_t pid = child_holding(take_convert_lock, tmp_path("turns"));
    int fd = -1;
    calls = 0;
    FAILS(kpl_convert_lock(tmp_path("turns"), give_up_third, NULL, &fd), KPL_ECANCELED,
          ".kpl-convert.lock");
    assert_int_equal(calls, 3);
    assert_int_equal(fd, -1);
    kill_child(pid); /* its lock goes with it */
    calls = 0;
    OK(kpl_convert_lock(tmp_path("turns"), give_up_third, NULL, &fd));
    assert_int_equal(calls, 0);
    kpl_convert_unlock(fd);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_states),
        cmocka_unit_test(test_legacy_marker),
        cmocka_unit_test(test_abandon_keeps_others_files),
        cmocka_unit_test(test_convert_lock),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
