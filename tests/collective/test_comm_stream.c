/* test_comm_stream.c — comm.c's care for memory a stream backend (NCCL)
 * may still write, without a GPU: a communicator made by hand whose host
 * slot holds a stand-in stream backend (run == NULL), so host tensors take
 * the stream path.  The stand-in's enqueue, order and query fail or
 * succeed as each case asks.
 *  - enqueue fails after the library took the operation (busy): the
 *    tensors stay retained for good, with a report line; not busy: freed.
 *  - a work handle destroyed when order fails: the host waits for the
 *    marker instead (tensors freed once it is done); when the marker fails
 *    too, the tensors stay.
 *  - order works: the tensors go at once. */
#include "kpl_test.h"
#include "collective_impl.h"

#include <stdlib.h>
#include <string.h>

static struct {
    bool enqueue_fails, busy, order_fails, query_fails;
    int query_calls, done_after; /* query says done from this call on */
    int events_freed;
    char report[1024];
} fake;

static int marker; /* the stand-in's completion marker */

static kpl_status fake_init(const kpl__comm_boot *boot, void **state)
{
    (void)boot;
    *state = NULL;
    return KPL_OK;
}

static void fake_fini(void *state) { (void)state; }

static kpl_status fake_enqueue(void *state, const kpl__coll_args *a, void **event, bool *busy)
{
    (void)state, (void)a;
    *event = NULL;
    *busy = false;
    if (fake.enqueue_fails) {
        *busy = fake.busy;
        return KPL_ERROR(KPL_ECOMM, "stand-in: the operation failed after it was taken");
    }
    *event = &marker;
    return KPL_OK;
}

static kpl_status fake_query(void *state, void *event, bool *done)
{
    (void)state, (void)event;
    *done = ++fake.query_calls >= fake.done_after;
    if (fake.query_fails) return KPL_ERROR(KPL_ECOMM, "stand-in: an asynchronous error");
    return KPL_OK;
}

static kpl_status fake_order(void *state, void *event)
{
    (void)state, (void)event;
    return fake.order_fails ? KPL_ERROR(KPL_EDEVICE, "stand-in: cannot order the stream")
                            : KPL_OK;
}

static void fake_event_free(void *state, void *event)
{
    (void)state;
    assert_ptr_equal(event, &marker);
    fake.events_freed++;
}

static const kpl__comm_backend fake_backend = {
    .name = "stand-in",
    .device_type = KPL_DEVICE_CPU,
    .init = fake_init,
    .fini = fake_fini,
    .run = NULL,
    .enqueue = fake_enqueue,
    .query = fake_query,
    .order = fake_order,
    .event_free = fake_event_free,
};

static void on_report(const char *line, void *user)
{
    (void)user;
    snprintf(fake.report, sizeof fake.report, "%s", line);
}

/* A communicator of one rank whose host slot is the stand-in. */
static kpl_comm *hand_made(void)
{
    kpl_comm *c = calloc(1, sizeof *c);
    assert_non_null(c);
    c->size = 1;
    c->timeout = 2;
    c->report = on_report;
    c->insp = c->host.mpi = c->dev.mpi = MPI_COMM_NULL;
    c->host.be = &fake_backend;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv_queue, NULL);
    pthread_cond_init(&c->cv_done, NULL);
    pthread_cond_init(&c->cv_watch, NULL);
    c->device = kpl_device_cpu();
    memset(&fake, 0, sizeof fake);
    return c;
}

static kpl_tensor *tensor(void)
{
    int64_t n = 1000;
    kpl_tensor *t = NULL;
    OK(kpl_tensor_zeros(kpl_device_cpu(), KPL_F32, 1, &n, &t));
    return t;
}

static void test_enqueue_fails_busy(void **state)
{
    (void)state;
    kpl_comm *c = hand_made();
    kpl_tensor *t = tensor();
    kpl_comm_work *w = NULL;
    fake.enqueue_fails = true;
    fake.busy = false;
    FAILS(kpl_comm_allreduce_async(c, t, t, KPL_COMM_SUM, &w), KPL_ECOMM, "failed after it");
    assert_int_equal(kpl_tensor_refcount(t), 1); /* nothing runs: freed */
    assert_string_equal(fake.report, "");
    fake.busy = true;
    FAILS(kpl_comm_allreduce_async(c, t, t, KPL_COMM_SUM, &w), KPL_ECOMM,
          "allreduce #1 (f32, 1000 elements) on backend stand-in");
    assert_null(w);
    /* in place: retained as in and as out, both kept */
    assert_int_equal(kpl_tensor_refcount(t), 3);
    assert_non_null(strstr(fake.report, "allreduce #1 (f32, 1000 elements) on backend stand-in, rank 0 of 1: "
                                        "the backend failed after taking the operation"));
    assert_non_null(strstr(fake.report, "its tensors (8000 bytes) are kept, never reused"));
    for (int k = 0; k < 3; k++) kpl_tensor_release(t); /* the test knows the kept ones */
    kpl_comm_destroy(c);
}

static void test_destroy_order_fails(void **state)
{
    (void)state;
    kpl_comm *c = hand_made();
    kpl_tensor *in = tensor(), *out = tensor();
    kpl_comm_work *w = NULL;
    OK(kpl_comm_allreduce_async(c, in, out, KPL_COMM_SUM, &w));
    assert_int_equal(kpl_tensor_refcount(in), 2);
    /* order fails, the marker completes on the third poll: the host waited */
    fake.order_fails = true;
    fake.done_after = 3;
    kpl_comm_work_destroy(w);
    assert_int_equal(fake.query_calls, 3);
    assert_int_equal(fake.events_freed, 1);
    assert_int_equal(kpl_tensor_refcount(in), 1);
    assert_int_equal(kpl_tensor_refcount(out), 1);
    assert_string_equal(fake.report, "");
    /* order and the marker fail: the end is unknown, the tensors stay */
    OK(kpl_comm_allreduce_async(c, in, out, KPL_COMM_SUM, &w));
    fake.query_calls = 0;
    fake.done_after = 1000000;
    fake.query_fails = true;
    kpl_comm_work_destroy(w);
    assert_int_equal(fake.events_freed, 2);
    assert_int_equal(kpl_tensor_refcount(in), 2);
    assert_int_equal(kpl_tensor_refcount(out), 2);
    assert_non_null(strstr(fake.report, "the compute stream could not be ordered after it, nor "
                                        "its end seen on the host"));
    for (int k = 0; k < 2; k++) kpl_tensor_release(in), kpl_tensor_release(out);
    /* the failure broke the communicator (a peer failed) */
    pthread_mutex_lock(&c->mu);
    bool stuck = c->stuck;
    c->stuck = false; /* so that destroy frees it (a stuck one is left to the job's end) */
    pthread_mutex_unlock(&c->mu);
    assert_true(stuck);
    kpl_comm_destroy(c);
}

static void test_destroy_ordered(void **state)
{
    (void)state;
    kpl_comm *c = hand_made();
    kpl_tensor *t = tensor();
    kpl_comm_work *w = NULL;
    OK(kpl_comm_allreduce_async(c, t, t, KPL_COMM_SUM, &w));
    OK(kpl_comm_work_wait(w)); /* orders, does not wait */
    assert_int_equal(fake.query_calls, 0);
    kpl_comm_work_destroy(w);
    assert_int_equal(fake.query_calls, 0);
    assert_int_equal(kpl_tensor_refcount(t), 1);
    kpl_tensor_release(t);
    kpl_comm_destroy(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_enqueue_fails_busy),
        cmocka_unit_test(test_destroy_order_fails),
        cmocka_unit_test(test_destroy_ordered),
    };
    return cmocka_run_group_tests_name("comm_stream", tests, NULL, NULL);
}
