/*
 * cpu_parallel.c — how much work an OpenMP fork must carry to pay for
 * itself, measured once per process.
 *
 * An OpenMP parallel region costs what it takes to wake the team: under
 * 1 us while idle threads spin (libgomp's default), 20-60 us when they
 * sleep (OMP_WAIT_POLICY=PASSIVE, the setting for shared machines; most
 * of it is the scheduler waking an idle virtual CPU).  An element-wise
 * pass over 600k f32 values takes ~50 us on one core, so with sleeping
 * threads the fork made LeNet's activations slower, while with spinning
 * ones it halves their time.  The serial threshold of the element-wise,
 * reduction, pooling and indexing kernels is therefore derived from the
 * fork latency measured here rather than fixed.
 */
#include "kernels_impl.h"

#include <omp.h>
#include <pthread.h>
#include <time.h>

/* f32 elements one thread streams through a simple element-wise formula
 * per second (a ReLU over 128x6x28x28 takes ~49 us here). */
#define ELEMENTS_PER_SECOND 12e9
#define GRAIN_MIN ((int64_t)32768)
#define GRAIN_MAX ((int64_t)1 << 20)

static pthread_once_t once = PTHREAD_ONCE_INIT;
static int64_t grain = GRAIN_MIN;
static double latency;

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The median of 9 empty parallel regions over the whole team, each after
 * 100 us of busy waiting on this thread (as a region inside a training
 * step follows serial work, by which time sleeping threads are asleep). */
static void calibrate(void)
{
    int team = omp_get_max_threads();
    if (team <= 1) return;
    volatile int sink = 0;
#pragma omp parallel num_threads(team)
    sink = omp_get_thread_num(); /* creates the threads */
    double t[9];
    for (int r = 0; r < 9; r++) {
        double g = kpl_seconds();
        while (kpl_seconds() - g < 100e-6) {
        }
        double t0 = kpl_seconds();
#pragma omp parallel num_threads(team)
        sink = omp_get_thread_num();
        t[r] = kpl_seconds() - t0;
    }
    (void)sink;
    qsort(t, 9, sizeof t[0], cmp_double);
    latency = t[4];
    /* A region over n elements takes ~latency + n / (team rate); serial
     * takes n / rate: the fork pays once n > 2 latency rate, i.e. once
     * each of two threads gets more than latency * rate elements. */
    double g = latency * ELEMENTS_PER_SECOND;
    grain = g < (double)GRAIN_MIN ? GRAIN_MIN : g > (double)GRAIN_MAX ? GRAIN_MAX : (int64_t)g;
}

int64_t kpl__cpu_par_grain(void)
{
    pthread_once(&once, calibrate);
    return grain;
}
