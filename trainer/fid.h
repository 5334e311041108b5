/*
 * fid.h — Fréchet distance (FID) and Inception Score of generated images,
 * in C, over the features and class probabilities of a feature network
 * (docs/fid.md).
 *
 * FID compares two sets of images through the Gaussians fitted to their
 * features: |mu1 - mu2|^2 + Tr(S1 + S2 - 2 (S1 S2)^(1/2)), as pytorch-fid's
 * calculate_frechet_distance defines it (numpy.cov's unbiased covariance,
 * scipy's matrix square root), computed here through symmetric
 * eigendecompositions (LAPACKE) and products (CBLAS) in double precision.
 * The features come from a classifier's penultimate layer: Inception-v3's
 * pool3 (2048) in the papers; here any classifier of kpl's zoo with a kpl
 * checkpoint, by default a small CNN trained on Fashion-MNIST (128
 * features), so the figures rank models but are not Inception FIDs.
 * The library only loads that checkpoint: `kpl data fid-net` makes it
 * (trains the recipe once, as kpl train does), and a missing file is an
 * error (KPL_ENOTFOUND naming it), never a training started here.
 *
 *   kpl_feature_net *net = NULL;
 *   kpl_fid_stats *real = NULL, *fake = NULL;
 *   double fid = 0;
 *   // the network's file, made beforehand by `kpl data fid-net`
 *   kpl_status st = kpl_feature_net_create(KPL_FID_DEFAULT_RECIPE, KPL_FID_DEFAULT_NETWORK,
 *                                          kpl_device_cpu(), &net);
 *   if (st >= 0) st = kpl_fid_stats_create(kpl_feature_net_dim(net), &real);
 *   if (st >= 0) st = kpl_fid_stats_create(kpl_feature_net_dim(net), &fake);
 *   for (each batch of real images x and generated images g, (N, C, H, W) in [0, 1]) {
 *       kpl_pool *p = kpl_pool_push();
 *       kpl_tensor *f = NULL;
 *       st = kpl_feature_net_run(net, x, &f, NULL);
 *       if (st >= 0) st = kpl_fid_stats_add(real, kpl_tensor_host_data(f), kpl_tensor_shape(f)[0]);
 *       ... the same for g into fake ...
 *       kpl_pool_pop(p);
 *   }
 *   // several ranks: kpl_trainer_sum(t, kpl_fid_stats_sums(fake), kpl_fid_stats_len(fake))
 *   if (st >= 0) st = kpl_fid(real, fake, &fid);
 *
 * Statistics are running sums (count, sum, sum of outer products) in
 * double, so ranks add theirs element-wise and any batching gives the same
 * figures.  Every function is blocking.  A kpl_fid_stats or kpl_feature_net
 * is used by one thread at a time; the free functions keep no state.  The
 * O(dim^3) work runs on the BLAS/LAPACK threads (OpenBLAS: all cores, or
 * OPENBLAS_NUM_THREADS / OMP_NUM_THREADS when set, as kplrun sets it).
 */
#ifndef KPL_FID_H
#define KPL_FID_H

#include "module.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The stand-in feature network: the default recipe's CNN, trained once by
 * `kpl data fid-net` (with no arguments) into this file (paths relative to
 * the working directory, as a recipe's data.root). */
#define KPL_FID_DEFAULT_RECIPE "recipes/fashion_mnist/cnn.yaml"
#define KPL_FID_DEFAULT_NETWORK "data/fid/fmnist_cnn.kpl"

/* ---- feature statistics ------------------------------------------------------------------ */

/* Running sums of feature vectors: count, sum (dim), sum of outer products
 * (dim x dim, both triangles), f64. */
typedef struct kpl_fid_stats kpl_fid_stats;

/* Empty statistics of dim-long features (1 <= dim <= 65536; the sums take
 * 8 (1 + dim + dim^2) bytes: 32 MiB for 2048).  *out owned by the caller. */
kpl_status kpl_fid_stats_create(int64_t dim, kpl_fid_stats **out);
/* NULL is a no-op. */
void kpl_fid_stats_destroy(kpl_fid_stats *s);
/* Back to no samples. */
void kpl_fid_stats_reset(kpl_fid_stats *s);
int64_t kpl_fid_stats_dim(const kpl_fid_stats *s);
/* Samples added so far (the count sum). */
int64_t kpl_fid_stats_count(const kpl_fid_stats *s);
/* Adds n feature rows (n x dim f32, row-major; n >= 0).  KPL_EINVAL
 * naming the row and column of a NaN or infinite value (nothing of the
 * batch is added then).  O(n dim^2) (BLAS dsyrk). */
kpl_status kpl_fid_stats_add(kpl_fid_stats *s, const float *features, int64_t n);
/* The raw sums as one contiguous array of kpl_fid_stats_len doubles:
 * [0] the count, [1, 1 + dim) the sum, then the dim x dim sum of outer
 * products, row-major.  Borrowed (s owns it); writable, for an all-reduce
 * across ranks: sum every rank's arrays element-wise in place (e.g.
 * kpl_trainer_sum), and every rank holds the statistics of all. */
double *kpl_fid_stats_sums(kpl_fid_stats *s);
size_t kpl_fid_stats_len(const kpl_fid_stats *s);
/* Adds b's sums into a (the same dims, else KPL_EINVAL): two halves make
 * the whole, as the all-reduce does. */
kpl_status kpl_fid_stats_merge(kpl_fid_stats *a, const kpl_fid_stats *b);
/* The mean mu (dim) and the covariance sigma (dim x dim, row-major,
 * unbiased, as numpy.cov(rowvar=False): (sum of outer products - n mu
 * mu^T) / (n - 1)).  KPL_EINVAL with fewer than 2 samples.  Either
 * output may be NULL. */
kpl_status kpl_fid_stats_moments(const kpl_fid_stats *s, double *mu, double *sigma);

/* Writes s to path (through path.tmp, fsync'd and renamed: a crash leaves
 * the old file or the new one): a small header (magic "KPLFIDST", format
 * version, dim, CRC32C of header and sums; docs/fid.md) and the raw sums.
 * tag (may be NULL; at most 1023 bytes) says what the statistics are of,
 * e.g. the network (kpl_feature_net_id) and the data set, so a cache can
 * be checked before use.  KPL_EIO naming the file. */
kpl_status kpl_fid_stats_save(const kpl_fid_stats *s, const char *tag, const char *path);
/* Reads a file of kpl_fid_stats_save into new statistics (*out owned by
 * the caller), and its tag into tag (len bytes with the NUL; may be NULL).
 * KPL_ENOTFOUND for a missing file, KPL_EIO for one that cannot be read,
 * KPL_EFORMAT naming the file and what is wrong (magic, version, size,
 * checksum) for anything else. */
kpl_status kpl_fid_stats_load(const char *path, kpl_fid_stats **out, char *tag, size_t len);

/* ---- the distances ----------------------------------------------------------------------- */

/* Fréchet distance between N(mu1, s1) and N(mu2, s2), dim-dimensional
 * (s1, s2 dim x dim, symmetric positive semi-definite, row-major):
 * |mu1 - mu2|^2 + Tr(s1) + Tr(s2) - 2 Tr((s1 s2)^(1/2)).  The trace of the
 * square root is the sum of the square roots of the eigenvalues of s1 s2,
 * taken from a symmetric matrix similar to it (docs/fid.md says why this
 * equals the trace of scipy.linalg.sqrtm(s1 s2)): L^T s2 L with s1's
 * Cholesky factor L when s1 (or else s2) is positive definite, else W^T
 * s2 W with W = V D^(1/2) from s1's eigendecomposition V D V^T (negative
 * eigenvalues, rounding of zeros, taken as 0, in both steps).  Singular
 * covariances (fewer samples than dims, dead features) need no offset:
 * the result is the limit that pytorch-fid's eps I offset approaches.  A
 * result a hair below 0 (rounding, for equal inputs) is returned as is.
 * KPL_EINVAL for dim < 1 or a NaN or infinite input (naming it);
 * KPL_EBACKEND when LAPACK fails.  O(dim^3): about 2 s for dim 2048 on 2
 * cores, 5x faster than scipy's sqrtm (bench/README.md). */
kpl_status kpl_fid_from_moments(int64_t dim, const double *mu1, const double *s1,
                                const double *mu2, const double *s2, double *fid);
/* The Fréchet distance of two statistics' moments.  KPL_EINVAL when their
 * dims differ or either has fewer than 2 samples, naming which. */
kpl_status kpl_fid(const kpl_fid_stats *a, const kpl_fid_stats *b, double *fid);

/* Inception Score of n class-probability rows (probs: n x classes, f32,
 * row-major, each row >= 0 summing to 1 within 1e-3) in `splits` parts:
 * the mean and the standard deviation (numpy.std: divided by splits) over
 * the parts of exp(E_x KL(p(y|x) || p(y))), p(y) the part's mean row, and
 * 0 log 0 taken as 0.  Part i holds rows [i n / splits, (i + 1) n /
 * splits) (integer division), the convention of the original Inception
 * Score code and of torch-fidelity, so parts differ by at most one row.
 * The rows are taken in the given order (torch-fidelity shuffles them
 * first with a fixed seed; generated samples are in random order
 * already).  KPL_EINVAL for splits < 1, n < splits, classes < 1, or a row
 * that is not a distribution (naming it).  Computed in double. */
kpl_status kpl_inception_score(const float *probs, int64_t n, int64_t classes, int splits,
                               double *mean, double *std);

/* ---- the feature network ----------------------------------------------------------------- */
/*
 * A classifier used as a feature extractor: the model a recipe describes
 * (its model section, through the zoo) with the weights of a kpl
 * checkpoint ("model.*" tensors, as kpl train writes them).  Features are
 * the input of the model's last linear layer (the penultimate activations),
 * logits its output.  Supported: models whose tree is a sequential ending
 * in a linear layer, which the zoo's mlp, lenet, cnn (the hidden layer's
 * ReLU output) and resnet (the pooled features; num_classes > 0) are;
 * other models are refused, naming what their tree is.
 */
typedef struct kpl_feature_net kpl_feature_net;

/* Builds the recipe's model on dev (NULL: the CPU), loads every "model.*"
 * tensor of the checkpoint (strict: a tensor missing on either side, or a
 * shape that differs, is an error naming the file), and puts it in
 * evaluation mode.  The input (C, H, W) is the recipe's model.in_channels
 * and input_size, else its validation transform's channels and size, else
 * the stored size of its validation images (converted first when the
 * recipe says how, as kpl eval does).  The recipe's validation mean and
 * std are applied by kpl_feature_net_run.  Errors name the recipe or the
 * checkpoint: KPL_ENOTFOUND for a checkpoint that does not exist (nothing
 * is trained here; `kpl data fid-net --recipe R -o FILE` makes it).  *out
 * owned by the caller. */
kpl_status kpl_feature_net_create(const char *recipe_path, const char *checkpoint_path,
                                  kpl_device *dev, kpl_feature_net **out);
/* The same with KEY=VALUE overrides of the recipe, as the network was
 * trained (`kpl data fid-net --recipe R KEY=VALUE...`): data.root, model.width
 * and the like decide where its input size comes from and its shapes. */
kpl_status kpl_feature_net_create_with(const char *recipe_path, int noverrides,
                                       const char *const *overrides,
                                       const char *checkpoint_path, kpl_device *dev,
                                       kpl_feature_net **out);
/* NULL is a no-op. */
void kpl_feature_net_destroy(kpl_feature_net *f);
/* The feature size (the last linear layer's input) and the classes (its
 * output). */
int64_t kpl_feature_net_dim(const kpl_feature_net *f);
int64_t kpl_feature_net_classes(const kpl_feature_net *f);
/* The input the model takes: (C, H, W), borrowed. */
const int64_t *kpl_feature_net_input_shape(const kpl_feature_net *f);
/* "<checkpoint file name> crc32c <8 hex digits of the file's CRC32C> dim
 * <dim>": what statistics made with this network are of, for the tag of
 * kpl_fid_stats_save (borrowed). */
const char *kpl_feature_net_id(const kpl_feature_net *f);
/* The module (borrowed; the net owns it): the recipe's model, weights
 * loaded, in evaluation mode. */
kpl_module *kpl_feature_net_model(kpl_feature_net *f);

/* Features and class probabilities of images: (N, C, H, W) f32 in [0, 1]
 * (pixel / 255), on any device.  The net moves them to its device,
 * replicates a 1-channel input to 3 channels or averages 3 to 1 when its
 * input wants that, resizes them bilinearly (align_corners false) to its
 * input size when H, W differ, and applies its recipe's validation
 * (x - mean) / std.  *features (N, dim) and *probs (N, classes) (softmax
 * of the logits) are f32 on the net's device, owned by the current pool;
 * either out pointer may be NULL.  Runs with grad mode off (restored
 * after) and the model in evaluation mode.  KPL_EINVAL for a tensor that
 * is not 4-d f32 or has channels other than 1, 3 or the model's (naming
 * the shape); an op's status otherwise. */
kpl_status kpl_feature_net_run(kpl_feature_net *f, kpl_tensor *images, kpl_tensor **features,
                               kpl_tensor **probs);

#ifdef __cplusplus
}
#endif
#endif /* KPL_FID_H */
