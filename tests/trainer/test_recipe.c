/* test_recipe.c — recipes: defaults, overrides, bases, the resolved YAML
 * reading back to the same recipe, every error naming file, line and key,
 * the project's own recipes, and damaged YAML that must fail cleanly. */
#include "kpl_test.h"
#include "recipe_case.h"
#include "run_impl.h"

#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

/* a model and data: two lines, so the keys under test start on line 3 */
#define MD "model: {name: cnn, num_classes: 10}\ndata: {train: {path: train, batch_size: 32}}\n"
#define MIN "epochs: 3\nmodel: {name: cnn, num_classes: 10}\n" \
            "data: {train: {path: train, batch_size: 32}}\noptimizer: {lr: 0.1}\n"

static kpl_recipe R;
static char dir[64];

static void write_file(const char *name, const char *text, char *path, size_t len)
{
    kpl_test_write(dir, name, text, path, len);
}

/* Each case written to bad.yaml and loaded (recipe_case.h). */
static void check_cases(const recipe_case *cases, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        char path[128];
        write_file("bad.yaml", cases[i].yaml, path, sizeof path);
        check_recipe_case(i, &cases[i], path, &R);
    }
}

static void test_defaults(void **state)
{
    (void)state;
    OK(kpl_recipe_load_string(MIN, "min", 0, NULL, &R));
    assert_int_equal(R.epochs, 3);
    assert_string_equal(R.model.name, "cnn");
    assert_int_equal(R.data.train.loader.batch_size, 32);
    assert_int_equal(R.data.train.loader.shuffle, KPL_SHUFFLE_CHUNK);
    assert_int_equal(R.data.val.loader.shuffle, KPL_SHUFFLE_NONE);
    assert_string_equal(R.data.val.path, "");
    assert_string_equal(R.optimizer.config.name, "sgd");
    assert_float_equal(R.optimizer.config.lr, 0.1, 0);
    assert_float_equal(R.optimizer.config.beta1, 0.9, 0);
    assert_float_equal(R.optimizer.config.beta2, 0.999, 0);
    assert_int_equal(R.schedule.config.kind, KPL_SCHED_CONSTANT);
    assert_float_equal(R.dist.buckets.bucket_mb, 25, 0);
    assert_true(R.dist.buckets.check_params);
    assert_int_equal(R.dist.buckets.grad_dtype, KPL_F32);
    assert_float_equal(R.data.train.loader.transform.scale[0], 0.08f, 0);
    assert_float_equal(R.data.train.loader.transform.ratio[1], 4.0f / 3.0f, 0);
    assert_null(R.data.train.loader.transform.image_feature); /* the recipe holds no pointers */
    assert_string_equal(R.data.train.image_feature, "image");
    assert_int_equal(R.checkpoint.keep_last, 3);
    assert_string_equal(R.device, "auto");
    assert_string_equal(R.name, "run"); /* no file: a neutral name */
}

static void test_overrides(void **state)
{
    (void)state;
    const char *ov[] = {"optimizer.lr=0.25", "model.hidden=[64, 32]",
                        "data.train.transform.size=24", "data.val.path=test",
                        "schedule.name=multistep", "schedule.milestones=[2, 4]", "name=x_y",
                        "log.tensorboard=off", "run_dir="};
    OK(kpl_recipe_load_string(MIN, "min", 9, ov, &R));
    assert_float_equal(R.optimizer.config.lr, 0.25, 0);
    assert_int_equal(R.model.nhidden, 2);
    assert_int_equal(R.model.hidden[1], 32);
    assert_int_equal(R.data.train.loader.transform.out_h, 24); /* one value: a square */
    assert_int_equal(R.data.train.loader.transform.out_w, 24);
    assert_string_equal(R.data.val.path, "test");
    assert_int_equal(R.schedule.config.kind, KPL_SCHED_MULTISTEP);
    assert_float_equal(R.schedule.config.milestones[1], 4, 0);
    assert_string_equal(R.name, "x_y");
    assert_false(R.log.tensorboard);
    assert_string_equal(R.run_dir, "");
}

/* A base recipe, a file laid over it section by section, then overrides. */
static void test_base(void **state)
{
    (void)state;
    char base[128], child[128], loop[128];
    write_file("base.yaml", MIN "optimizer: {lr: 0.5, momentum: 0.9}\nseed: 7\n", base,
               sizeof base);
    (void)base;
    /* the base's optimizer.lr appears twice above: a duplicate key */
    FAILS(kpl_recipe_load(base, 0, NULL, &R), KPL_EFORMAT, "appears twice");
    write_file("base.yaml",
               "epochs: 3\nmodel: {name: cnn, num_classes: 10}\nseed: 7\n"
               "data: {train: {path: train, batch_size: 32}}\n"
               "optimizer: {lr: 0.5, momentum: 0.9}\n",
               base, sizeof base);
    write_file("child.yaml", "base: base.yaml\noptimizer:\n  lr: 0.05\nepochs: 4\n", child,
               sizeof child);
    const char *ov[] = {"seed=9"};
    OK(kpl_recipe_load(child, 1, ov, &R));
    assert_float_equal(R.optimizer.config.lr, 0.05, 0);
    assert_float_equal(R.optimizer.config.momentum, 0.9, 0); /* kept from the base */
    assert_int_equal(R.epochs, 4);
    assert_int_equal(R.seed, 9);
    assert_string_equal(R.name, "child");
    write_file("loop.yaml", "base: loop.yaml\n", loop, sizeof loop);
    FAILS(kpl_recipe_load(loop, 0, NULL, &R), KPL_EINVAL, "deeper than 8");
    write_file("child.yaml", "base: nothere.yaml\n", child, sizeof child);
    FAILS(kpl_recipe_load(child, 0, NULL, &R), KPL_EIO, "child.yaml:1:7: in base");
}

/* Each bad recipe: the status and the words the message must hold. */
static void test_errors(void **state)
{
    (void)state;
    static const recipe_case cases[] = {
        {MIN "optimizer2: 1\n", NULL, KPL_EINVAL, "bad.yaml:5:1: unknown key 'optimizer2'"},
        {MD "epochs: 3\noptimizer:\n  lrr: 0.1\n", NULL, KPL_EINVAL,
         "bad.yaml:5:3: unknown key 'optimizer.lrr' (did you mean 'optimizer.lr'?)"},
        {MD "epochs: abc\n", NULL, KPL_EINVAL, "bad.yaml:3:9: epochs: expected an integer, got 'abc'"},
        {MD "epochs: 1.5\n", NULL, KPL_EINVAL, "epochs: expected an integer, got '1.5'"},
        {MIN "seed: -1\n", NULL, KPL_ERANGE, "bad.yaml:5:7: seed: -1 is out of range"},
        {MD "epochs: 3\noptimizer: {lr: 0.1, momentum: 1.5}\n", NULL, KPL_ERANGE,
         "optimizer.momentum: 1.5 is out of range [0, 0.9999]"},
        {MD "epochs: 3\noptimizer: {lr: fast}\n", NULL, KPL_EINVAL,
         "optimizer.lr: expected a number, got 'fast'"},
        {MD "epochs: 3\noptimizer: {lr: .nan}\n", NULL, KPL_EINVAL, "expected a number"},
        {"model: {name: cnn}\n", NULL, KPL_EINVAL, "bad.yaml: missing required key 'epochs'"},
        {"epochs: 2\nmodel: {name: cnn}\ndata: {train: {path: t, batch_size: 8}}\n"
         "optimizer: {lr: 0.1}\n", NULL, KPL_EINVAL,
         "bad.yaml: missing required key 'model.num_classes' (task classification needs it)"},
        {"epochs: 2\ndata: {train: {path: t, batch_size: 8}}\noptimizer: {lr: 0.1}\n", NULL,
         KPL_EINVAL, "bad.yaml: missing required key 'model.name' (task classification needs it)"},
        {MIN "optimizer: {name: adagrad, lr: 1}\n", NULL, KPL_EFORMAT, "appears twice"},
        {MIN, "data.train.boxes_feature=boxes", KPL_EINVAL,
         "override 'data.train.boxes_feature=boxes': data.train.boxes_feature: needs "
         "data.train.max_boxes >= 1"},
        {MIN, "data.val.box_labels_feature=cls", KPL_EINVAL,
         "data.val.box_labels_feature: needs data.val.boxes_feature"},
        {MIN, "data.train.max_boxes=70000", KPL_ERANGE, "data.train.max_boxes: 70000 is out of range"},
        {"epochs: 2\nmodel: {name: vgg}\n", NULL, KPL_EINVAL,
         "model.name: expected one of mlp, lenet, cnn, resnet, fcos, deeplabv3, unet, dcgan, dcgan_d, sngan, sngan_d, none; got 'vgg'"},
        {MD "epochs: 2\noptimizer: 3\n", NULL, KPL_EINVAL, "bad.yaml:4:12: optimizer: is a section"},
        {MD "epochs: [1, 2]\n", NULL, KPL_EINVAL, "epochs: expected an integer, got a list"},
        {MIN "model: {hidden: {a: 1}}\n", NULL, KPL_EFORMAT,
         "appears twice"},
        {MIN, "model.hidden={a: 1}", KPL_EINVAL,
         "model.hidden: expected a list of integers, got a section"},
        {"epochs: 3\noptimizer: {lr: 1}\ndata: {train: {path: t, batch_size: 3}}\n"
         "model: {name: mlp, num_classes: 2, hidden: [1, x]}\n", NULL, KPL_EINVAL,
         "bad.yaml:4:48: model.hidden: expected an integer, got 'x'"},
        {MIN "log: {tensorboard: maybe}\n", NULL, KPL_EINVAL,
         "log.tensorboard: expected true or false, got 'maybe'"},
        {"epochs: 3\nepochs: 4\n", NULL, KPL_EFORMAT, "bad.yaml:2:1: key 'epochs' appears twice"},
        {"epochs: 3\n  bad indent: 1\n", NULL, KPL_EFORMAT, "bad.yaml:2:"},
        {"epochs: 3\nmodel: &m {name: cnn}\nx: *m\n", NULL, KPL_EFORMAT,
         "YAML aliases (*m) are not supported"},
        {"- 1\n- 2\n", NULL, KPL_EFORMAT, "a recipe is a mapping"},
        {"epochs: 3\n---\nepochs: 4\n", NULL, KPL_EFORMAT, "one YAML document"},
        {"epochs: 3\nmodel:\n", NULL, KPL_EINVAL, "bad.yaml:2:7: model: is a section of keys, not a value"},
        {MD "epochs:\n", NULL, KPL_EINVAL, "bad.yaml:3:8: epochs: no value"},
        /* YAML tags: refused wherever they stand, naming the key and the tag */
        {MD "epochs: !!str 5\n", NULL, KPL_EFORMAT,
         "bad.yaml:3:9: epochs: YAML tags (!!str) are not supported in recipes"},
        {MD "epochs: !!int 5\n", NULL, KPL_EFORMAT, "bad.yaml:3:9: epochs: YAML tags (!!int)"},
        {"epochs: 3\nmodel: !!map {name: cnn, num_classes: 10}\n", NULL, KPL_EFORMAT,
         "bad.yaml:2:8: model: YAML tags (!!map)"},
        {MIN "schedule: {milestones: !!seq [1, 2]}\n", NULL, KPL_EFORMAT,
         "bad.yaml:5:24: schedule.milestones: YAML tags (!!seq)"},
        {MIN "schedule: {milestones: [1, !!float 2]}\n", NULL, KPL_EFORMAT,
         "bad.yaml:5:28: schedule.milestones: YAML tags (!!float)"},
        {"!!str epochs: 3\n", NULL, KPL_EFORMAT, "bad.yaml:1:1: epochs: YAML tags (!!str)"},
        {"--- !!map\nepochs: 3\n", NULL, KPL_EFORMAT, "bad.yaml:1:5: YAML tags (!!map)"},
        {MD "epochs: ! 5\n", NULL, KPL_EFORMAT, "bad.yaml:3:9: epochs: YAML tags (!)"},
        {"%TAG !e! tag:example.com,2000:\n---\nname: !e!x run\n", NULL, KPL_EFORMAT,
         "bad.yaml:3:7: name: YAML tags (tag:example.com,2000:x)"},
        {MD "epochs: 3\noptimizer: {lr: 0.1, groups: [{params: !!str a}]}\n", NULL, KPL_EFORMAT,
         "bad.yaml:4:40: optimizer.groups[].params: YAML tags (!!str)"},
        {MIN, "epochs=!!int 3", KPL_EFORMAT,
         "override 'epochs=!!int 3': epochs: YAML tags (!!int) are not supported"},
        {MIN, "model={hidden: !!seq [3]}", KPL_EFORMAT,
         "override 'model={hidden: !!seq [3]}': model.hidden: YAML tags (!!seq)"},
        {MIN, "data.val.path=!local v", KPL_EFORMAT, "data.val.path: YAML tags (!local)"},
        /* rules across keys */
        {MIN "optimizer: {lr: 0.1, nesterov: true}\n", NULL, KPL_EFORMAT, "appears twice"},
        {MIN, "optimizer.nesterov=true", KPL_EINVAL,
         "override 'optimizer.nesterov=true': optimizer.nesterov: needs optimizer.name sgd and "
         "momentum > 0"},
        {MIN, "data.train.transform.mean=[0.5, 0.5]", KPL_EINVAL,
         "data.train.transform.mean: expected 1 value or 3 (one per channel), got 2"},
        {"epochs: 3\nmodel: {name: cnn, num_classes: 10}\noptimizer: {lr: 0.1}\n"
         "data: {train: {path: train, batch_size: 32, transform: {channels: 1}}}\n",
         "data.train.transform.std=[0.5, 0.5]", KPL_EINVAL,
         "data.train.transform.std: expected 1 value (transform.channels is 1), got 2"},
        {MIN, "data.val.transform.std=[0.5, 0.5, 0.5]", 0, "-"},
        /* names: one part of a path, printable */
        {MIN, "name=../../x", KPL_EINVAL,
         "override 'name=../../x': name: '../../x' may hold only letters, digits and . _ + -"},
        {MIN, "name=.hidden", KPL_EINVAL, "name: '.hidden' must not start with '.'"},
        {MIN "name: \"a\\nb\"\n", NULL, KPL_EINVAL, "bad.yaml:5:7: name: control character 0x0a"},
        {MIN "name: \"a\\0b\"\n", NULL, KPL_EFORMAT, "bad.yaml:5:7: a NUL character"},
        {MIN, "run_dir=\"runs/a\\tb\"", KPL_EINVAL, "run_dir: control character 0x09"},
        {MIN, "loss.nonfinite=ignore", KPL_EINVAL,
         "loss.nonfinite: expected one of stop, skip; got 'ignore'"},
        {MIN, "dist.grad_dtype=f16", KPL_EINVAL,
         "dist.grad_dtype: expected one of f32, fp16, bf16; got 'f16'"},
        {MIN, "data.train.skip_corrupt=1", KPL_EINVAL,
         "data.train.skip_corrupt: expected true or false"},
        {MIN, "schedule.name=multistep", KPL_EINVAL, "schedule.milestones: multistep needs"},
        {MIN, "schedule.milestones=[5, 3]", KPL_EINVAL, "schedule.milestones: must increase"},
        {MIN, "model.name=resnet", KPL_EINVAL, "model.depth: resnet depth is 18, 34, 50, 101 or "
                                               "152, got 0"},
        {MIN, "data.train.transform.crop=center", KPL_EINVAL,
         "data.train.transform.size: crop 'center' needs an output size"},
        {MIN, "device=gpu", KPL_EINVAL, "device: expected auto, cpu, cuda or cuda:N; got 'gpu'"},
        {MIN, "data.convert.from=idx", KPL_EINVAL, "data.convert.source: needed"},
        {MIN, "schedule.name=cosine", 0, "-"}, /* fine: epochs 3 > warmup 0 */
        {MIN, "schedule.min_lr=1", KPL_EINVAL, "schedule.min_lr: 1 is above optimizer.lr 0.1"},
        /* overrides */
        {MIN, "optimizer.lr=abc", KPL_EINVAL,
         "override 'optimizer.lr=abc': optimizer.lr: expected a number, got 'abc'"},
        {MIN, "nokey", KPL_EINVAL, "override 'nokey': expected KEY=VALUE"},
        {MIN, "epochs.x=1", KPL_EINVAL, "override 'epochs.x=1': 'epochs' is a value"},
        {MIN, "optimizer..lr=1", KPL_EINVAL, "empty part in the key"},
        {MIN, "optimizer.lr=[1", KPL_EFORMAT, "YAML syntax error"},
        {MIN, "optimiser.lr=1", KPL_EINVAL,
         "override 'optimiser.lr=1': unknown key 'optimiser.lr' (did you mean 'optimizer.lr'?)"},
    };
    check_cases(cases, sizeof cases / sizeof cases[0]);
    FAILS(kpl_recipe_load("/nonexistent/r.yaml", 0, NULL, &R), KPL_EIO,
          "recipe /nonexistent/r.yaml: No such file");
    /* only regular files of a sane size: /dev/zero would be read until
     * memory runs out */
    FAILS(kpl_recipe_load("/dev/zero", 0, NULL, &R), KPL_EINVAL,
          "recipe /dev/zero: not a regular file");
    char path[128];
    write_file("base_dev.yaml", "base: /dev/zero\nepochs: 3\n", path, sizeof path);
    FAILS(kpl_recipe_load(path, 0, NULL, &R), KPL_EINVAL, "in base: recipe /dev/zero: not a regular file");
    char *big = malloc((1 << 20) + 64);
    memset(big, '#', (1 << 20) + 63);
    big[(1 << 20) + 63] = 0;
    write_file("big.yaml", big, path, sizeof path);
    free(big);
    FAILS(kpl_recipe_load(path, 0, NULL, &R), KPL_EINVAL, "larger than 1 MiB");
}

/* A task kpl does not know: a program's own task loads (examples/
 * autoencoder.c), while the kpl command's loader refuses it as it does
 * any bad value, naming the task key's place or the override. */
static void test_task(void **state)
{
    (void)state;
    char path[128];
    write_file("task.yaml", MIN "task: autoencoder\n", path, sizeof path);
    OK(kpl_recipe_load(path, 0, NULL, &R));
    assert_string_equal(R.task, "autoencoder");
    FAILS(kpl__recipe_load_known_task(path, 0, NULL, &R), KPL_EINVAL,
          "task.yaml:5:7: task: unknown task 'autoencoder' (kpl train and kpl eval know: "
          "classification, detection, segmentation, gan;");
    const char *ov[] = {"task=tracking"};
    OK(kpl_recipe_load_string(MIN, "min", 1, ov, &R));
    write_file("task.yaml", MIN, path, sizeof path);
    FAILS(kpl__recipe_load_known_task(path, 1, ov, &R), KPL_EINVAL,
          "override 'task=tracking': task: unknown task 'tracking'");
    OK(kpl__recipe_load_known_task(path, 0, NULL, &R));
    assert_string_equal(R.task, "classification");
}

/* Long values are echoed cut short, so that the message keeps what is
 * wrong and where (it holds under 1 KiB): overrides, YAML scalars, keys,
 * and file names, which keep their end. */
static void test_long_values(void **state)
{
    (void)state;
    char x[1001], ov[1100], yaml[2400], path[1300];
    memset(x, 'x', 1000);
    x[1000] = 0;
    snprintf(ov, sizeof ov, "optimizer.lr=%s", x);
    const char *ovs[1] = {ov};
    FAILS(kpl_recipe_load_string(MIN, "min", 1, ovs, &R), KPL_EINVAL,
          "optimizer.lr: expected a number, got 'xxxxxxxxxx");
    assert_non_null(strstr(kpl_last_error(), "override 'optimizer.lr=xxxxxxxxxx"));
    assert_non_null(strstr(kpl_last_error(), "xxx...'"));
    assert_non_null(strstr(kpl_last_error(), "[trainer/io/recipe")); /* nothing cut off */
    /* the reason after the value: a number out of range, from a file */
    char z[901];
    memset(z, '0', 900);
    z[900] = 0;
    snprintf(yaml, sizeof yaml, MD "epochs: 3\noptimizer: {lr: 0.1, momentum: 1.%s5}\n", z);
    write_file("long.yaml", yaml, path, sizeof path);
    FAILS(kpl_recipe_load(path, 0, NULL, &R), KPL_ERANGE, "long.yaml:4:32: optimizer.momentum: 1.000");
    assert_non_null(strstr(kpl_last_error(), "0... is out of range [0, 0.9999]"));
    /* an unknown key, the hint kept */
    snprintf(yaml, sizeof yaml, MD "epochs: 3\noptimizer:\n  lr: 0.1\n  %s: 1\n", x);
    write_file("long.yaml", yaml, path, sizeof path);
    FAILS(kpl_recipe_load(path, 0, NULL, &R), KPL_EINVAL, "long.yaml:6:3: unknown key 'optimizer.xxx");
    assert_non_null(strstr(kpl_last_error(), "xxx...' [trainer/io/recipe"));
    /* a name, an enum, a bool, a string with a control character */
    static const char *const bad[][2] = {
        {"model.name=", "model.name: expected one of mlp, lenet, cnn, resnet, fcos, deeplabv3, unet, dcgan, dcgan_d, sngan, sngan_d, none; got 'xxx"},
        {"log.tensorboard=", "log.tensorboard: expected true or false, got 'xxx"},
        {"run_dir=\"\\t", "run_dir: control character 0x09 in '\txxx"},
        {"optimizer..lr=", "override 'optimizer..lr=xxx"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(ov, sizeof ov, "%s%s%s", bad[i][0], x, bad[i][0][strlen(bad[i][0]) - 1] == 't' ? "\"" : "");
        FAILS(kpl_recipe_load_string(MIN, "min", 1, ovs, &R), KPL_EINVAL, bad[i][1]);
        assert_non_null(strstr(kpl_last_error(), "...'"));
        assert_non_null(strstr(kpl_last_error(), "[trainer/io/recipe"));
    }
    /* a long file name keeps its end, and the reason */
    int at = snprintf(path, sizeof path, "/nonexistent");
    for (int i = 0; i < 9; i++) at += snprintf(path + at, sizeof path - (size_t)at, "/%.100s", x);
    snprintf(path + at, sizeof path - (size_t)at, "/r.yaml");
    FAILS(kpl_recipe_load(path, 0, NULL, &R), KPL_EIO, "xxx/r.yaml: No such file");
    assert_non_null(strstr(kpl_last_error(), "recipe ...x"));
    snprintf(yaml, sizeof yaml, "base: %s\n", path);
    write_file("long.yaml", yaml, path, sizeof path);
    FAILS(kpl_recipe_load(path, 0, NULL, &R), KPL_EIO, "long.yaml:1:7: in base: recipe ...x");
    assert_non_null(strstr(kpl_last_error(), "xxx/r.yaml: No such file"));
}

/* A recipe path that is not a regular file is refused by what it is,
 * before it is opened: a FIFO would wait for a writer forever (an alarm
 * ends the test if it does), a directory or a socket is no recipe either;
 * on the command line and as a base. */
static void test_not_regular(void **state)
{
    (void)state;
    alarm(20);
    char fifo[128], path[128];
    snprintf(fifo, sizeof fifo, "%s/r.fifo", dir);
    assert_int_equal(mkfifo(fifo, 0600), 0);
    FAILS(kpl_recipe_load(fifo, 0, NULL, &R), KPL_EINVAL, "not a regular file (a FIFO)");
    assert_non_null(strstr(kpl_last_error(), fifo));
    write_file("base_fifo.yaml", "epochs: 3\nbase: r.fifo\n", path, sizeof path);
    FAILS(kpl_recipe_load(path, 0, NULL, &R), KPL_EINVAL,
          "base_fifo.yaml:2:7: in base: recipe");
    assert_non_null(strstr(kpl_last_error(), "r.fifo: not a regular file (a FIFO)"));
    FAILS(kpl_recipe_load(dir, 0, NULL, &R), KPL_EINVAL, "not a regular file (a directory)");
    FAILS(kpl_recipe_load("/dev/null", 0, NULL, &R), KPL_EINVAL,
          "recipe /dev/null: not a regular file (a character device)");
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s/r.sock", dir);
    const char *sock = a.sun_path;
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    FAILS(kpl_recipe_load(sock, 0, NULL, &R), KPL_EINVAL, "not a regular file (a socket)");
    write_file("base_sock.yaml", "base: r.sock\n", path, sizeof path);
    FAILS(kpl_recipe_load(path, 0, NULL, &R), KPL_EINVAL, "r.sock: not a regular file (a socket)");
    close(fd);
    alarm(0);
}

/* An override that gives a section as a map lays it over the recipe's
 * section key by key, as `base:` does, instead of dropping the rest. */
static void test_override_merge(void **state)
{
    (void)state;
    const char *ov[] = {"data={train: {path: elsewhere}}", "optimizer={momentum: 0.5}"};
    OK(kpl_recipe_load_string("epochs: 3\nmodel: {name: cnn, num_classes: 10}\n"
                              "optimizer: {lr: 0.1}\n"
                              "data: {train: {path: train, batch_size: 32},\n"
                              "       val: {path: v, batch_size: 7}}\n",
                              "min", 2, ov, &R));
    assert_string_equal(R.data.train.path, "elsewhere");
    assert_int_equal(R.data.train.loader.batch_size, 32); /* MIN's, kept */
    assert_string_equal(R.data.val.path, "v");
    assert_int_equal(R.data.val.loader.batch_size, 7);
    assert_float_equal(R.optimizer.config.lr, 0.1, 0);
    assert_float_equal(R.optimizer.config.momentum, 0.5, 0);
    /* a value still replaces a value */
    const char *ov2[] = {"model.hidden=[4, 5]"};
    OK(kpl_recipe_load_string(MIN, "min", 1, ov2, &R));
    assert_int_equal(R.model.nhidden, 2);
    /* the default name of a file with odd characters is made safe */
    char path[128];
    write_file("my recipe (v2).yaml", MIN, path, sizeof path);
    OK(kpl_recipe_load(path, 0, NULL, &R));
    assert_string_equal(R.name, "my_recipe__v2_");
}

/* The resolved YAML reads back to the same recipe, with every key. */
static void test_round_trip(void **state)
{
    (void)state;
    const char *ov[] = {"optimizer.lr=0.1234567890123", "model.hidden=[3]",
                        "run_dir=quote\"and\\\\back", "data.train.transform.mean=[0.1, 0.2, 0.3]",
                        "schedule.min_lr=1e-7", "dist.grad_dtype=bf16"};
    OK(kpl_recipe_load_string(MIN, "min", 6, ov, &R));
    assert_int_equal(R.dist.buckets.grad_dtype, KPL_BF16);
    char *a = NULL, *b = NULL;
    OK(kpl_recipe_to_yaml(&R, &a));
    kpl_recipe *r2 = malloc(sizeof *r2);
    OK(kpl_recipe_load_string(a, "resolved", 0, NULL, r2));
    OK(kpl_recipe_to_yaml(r2, &b));
    assert_string_equal(a, b);
    assert_string_equal(r2->run_dir, "quote\"and\\\\back"); /* plain YAML: no escapes */
    assert_float_equal(r2->optimizer.config.lr, 0.1234567890123, 0);
    assert_float_equal(r2->schedule.config.min_lr, 1e-7, 0);
    assert_non_null(strstr(a, "  lr: 0.1234567890123\n"));
    assert_non_null(strstr(a, "    batch_size: 32\n"));
    assert_non_null(strstr(a, "  grad_dtype: bf16\n"));
    assert_int_equal(r2->dist.buckets.grad_dtype, KPL_BF16);
    const char *fp16 = "dist.grad_dtype=fp16";
    OK(kpl_recipe_load_string(MIN, "min", 1, &fp16, r2));
    assert_int_equal(r2->dist.buckets.grad_dtype, KPL_F16);
    free(a);
    free(b);
    free(r2);
}

/* profile.steps: off by default, [first, last] with 1 <= first <= last,
 * never one value (which a pair such as model.input_size takes for both);
 * the resolved YAML reads back. */
static void test_profile_steps(void **state)
{
    (void)state;
    OK(kpl_recipe_load_string(MIN, "min", 0, NULL, &R));
    assert_int_equal(R.profile.steps[0], 0);
    assert_int_equal(R.profile.steps[1], 0);
    const char *ov = "profile.steps=[3, 5]";
    OK(kpl_recipe_load_string(MIN, "min", 1, &ov, &R));
    assert_int_equal(R.profile.steps[0], 3);
    assert_int_equal(R.profile.steps[1], 5);
    char *a = NULL;
    OK(kpl_recipe_to_yaml(&R, &a));
    assert_non_null(strstr(a, "\nprofile:\n  steps: [3, 5]\n"));
    kpl_recipe *r2 = malloc(sizeof *r2);
    OK(kpl_recipe_load_string(a, "resolved", 0, NULL, r2));
    assert_int_equal(r2->profile.steps[0], 3);
    assert_int_equal(r2->profile.steps[1], 5);
    free(a);
    OK(kpl_recipe_load_string(MIN, "min", 0, NULL, r2));
    OK(kpl_recipe_to_yaml(r2, &a));
    assert_non_null(strstr(a, "\nprofile:\n  steps: []\n"));
    free(a);
    free(r2);
    ov = "profile.steps=[4, 4]"; /* one step */
    OK(kpl_recipe_load_string(MIN, "min", 1, &ov, &R));
    static const recipe_case cases[] = {
        {MIN "profile: {steps: [5, 3]}\n", NULL, KPL_EINVAL,
         "bad.yaml:5:18: profile.steps: expected [first, last] with first <= last, got [5, 3]"},
        {MIN "profile: {steps: [0, 2]}\n", NULL, KPL_ERANGE,
         "bad.yaml:5:19: profile.steps: 0 is out of range [1, "},
        {MIN "profile:\n  steps: 4\n", NULL, KPL_EINVAL,
         "bad.yaml:6:10: profile.steps: expected [first, last] (or [] for none)"},
        {MIN "profile: {steps: [1, x]}\n", NULL, KPL_EINVAL,
         "profile.steps: expected an integer, got 'x'"},
        {MIN "profile: 3\n", NULL, KPL_EINVAL, "profile"},
        {MIN, "profile.steps=[5,3]", KPL_EINVAL,
         "override 'profile.steps=[5,3]': profile.steps: expected [first, last] with first <= "
         "last, got [5, 3]"},
    };
    check_cases(cases, sizeof cases / sizeof cases[0]);
    /* never one value, nor three */
    static const char *const counts[] = {"[2]", "7", "[1, 2, 3]"};
    for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++) {
        char o[64];
        snprintf(o, sizeof o, "profile.steps=%s", counts[i]);
        ov = o;
        FAILS(kpl_recipe_load_string(MIN, "min", 1, &ov, &R), KPL_EINVAL,
              "profile.steps: expected [first, last] (or [] for none)");
    }
}

/* optimizer.groups: a list of maps, defaults, errors with file and line,
 * and the resolved YAML reading back. */
#define G MD "epochs: 3\noptimizer:\n  lr: 0.1\n"
static void test_groups(void **state)
{
    (void)state;
    OK(kpl_recipe_load_string(G "  groups:\n"
                              "    - {params: \"layer1.*\", lr_mult: 0.1}\n"
                              "    - params: '*.bias'\n      weight_decay_mult: 0\n",
                              "g", 0, NULL, &R));
    assert_int_equal(R.optimizer.ngroups, 2);
    assert_string_equal(R.optimizer.groups[0].params, "layer1.*");
    assert_float_equal(R.optimizer.groups[0].lr_mult, 0.1, 0);
    assert_float_equal(R.optimizer.groups[0].weight_decay_mult, 1, 0);
    assert_string_equal(R.optimizer.groups[1].params, "*.bias");
    assert_float_equal(R.optimizer.groups[1].lr_mult, 1, 0);
    assert_float_equal(R.optimizer.groups[1].weight_decay_mult, 0, 0);
    char *a = NULL;
    OK(kpl_recipe_to_yaml(&R, &a));
    assert_non_null(strstr(a, "  groups: [{params: \"layer1.*\", lr_mult: 0.1, "
                              "weight_decay_mult: 1.0}, {params: \"*.bias\", lr_mult: 1.0, "
                              "weight_decay_mult: 0.0}]\n"));
    kpl_recipe *r2 = malloc(sizeof *r2);
    OK(kpl_recipe_load_string(a, "resolved", 0, NULL, r2));
    assert_int_equal(r2->optimizer.ngroups, 2);
    assert_float_equal(r2->optimizer.groups[0].lr_mult, 0.1, 0);
    free(r2);
    free(a);
    const char *ov[] = {"optimizer.groups=[]"};
    OK(kpl_recipe_load_string(MIN, "min", 1, ov, &R));
    assert_int_equal(R.optimizer.ngroups, 0);
    FAILS(kpl_recipe_load_string(G "  groups:\n    - {lr_mult: 2}\n",
                                 "g", 0, NULL, &R),
          KPL_EINVAL, "g:7:7: optimizer.groups: a group needs params: PATTERN");
    FAILS(kpl_recipe_load_string(G "  groups:\n    - {params: a, lr: 2}\n",
                                 "g", 0, NULL, &R),
          KPL_EINVAL, "g:7:19: optimizer.groups[].lr: unknown key");
    FAILS(kpl_recipe_load_string(G "  groups:\n    - {params: a, lr_mult: x}\n",
                                 "g", 0, NULL, &R),
          KPL_EINVAL, "optimizer.groups[].lr_mult: expected a number, got 'x'");
    FAILS(kpl_recipe_load_string(G "  groups: {params: a}\n", "g", 0,
                                 NULL, &R),
          KPL_EINVAL, "optimizer.groups: expected a list of {params, lr_mult, weight_decay_mult}");
    FAILS(kpl_recipe_load_string(G "  groups: [{params: ''}]\n", "g", 0,
                                 NULL, &R),
          KPL_EINVAL, "optimizer.groups[].params: a pattern of 1 to 127 characters");
}

/* keep_ratio's keys bind into the transform, and its rules point at the
 * key to change. */
static void test_keep_ratio_keys(void **state)
{
    (void)state;
    const char *det = "epochs: 3\nmodel: {name: cnn, num_classes: 10}\noptimizer: {lr: 0.1}\n"
                      "data:\n  train:\n    path: train\n    batch_size: 2\n    transform:\n"
                      "      crop: keep_ratio\n      short_sides: [640, 672, 704, 736, 768, 800]\n"
                      "      max_side: 1333\n      mask_pad: 255\n"
                      "  val: {path: val, transform: {crop: keep_ratio, short_sides: 800, "
                      "max_side: 1333, size_divisor: 0}}\n";
    OK(kpl_recipe_load_string(det, "det", 0, NULL, &R));
    const kpl_transform_config *t = &R.data.train.loader.transform, *v = &R.data.val.loader.transform;
    assert_int_equal(t->crop, KPL_CROP_KEEP_RATIO);
    assert_int_equal(t->num_short_sides, 6);
    assert_int_equal(t->short_sides[0], 640);
    assert_int_equal(t->short_sides[5], 800);
    assert_int_equal(t->max_side, 1333);
    assert_int_equal(t->size_divisor, 32); /* the default */
    assert_int_equal(t->mask_pad, 255);
    assert_int_equal(v->num_short_sides, 1);
    assert_int_equal(v->short_sides[0], 800);
    assert_int_equal(v->size_divisor, 0);
    assert_int_equal(v->mask_pad, 0);
    assert_int_equal(kpl_transform_canvas_side(t), 1344);
    /* the resolved YAML reads back to the same values */
    char *yaml = NULL;
    OK(kpl_recipe_to_yaml(&R, &yaml));
    assert_non_null(strstr(yaml, "short_sides: [640, 672, 704, 736, 768, 800]"));
    free(yaml);

    static const recipe_case cases[] = {
        {"epochs: 3\nmodel: {name: cnn, num_classes: 10}\noptimizer: {lr: 0.1}\ndata:\n"
         "  train: {path: t, batch_size: 3, transform: {crop: keep_ratio, max_side: 1333}}\n",
         NULL, KPL_EINVAL, "bad.yaml:5:53: data.train.transform.crop: keep_ratio needs "
         "data.train.transform.short_sides (e.g. [800], or [640, 672, 704, 736, 768, 800] to "
         "train at several scales)"},
        {MIN, "data.train.transform={crop: keep_ratio, short_sides: [800]}", KPL_EINVAL,
         "data.train.transform.crop: keep_ratio needs data.train.transform.max_side (e.g. 1333)"},
        {MIN "data: {train: {transform: {crop: keep_ratio, short_sides: 8, max_side: 9, "
             "size: 8}}}\n", NULL, KPL_EFORMAT, "appears twice"},
        {MIN, "data.train.transform={crop: keep_ratio, short_sides: 8, max_side: 9, size: 8}",
         KPL_EINVAL, "data.train.transform.size: not with crop keep_ratio, which sizes each "
                     "image by data.train.transform.short_sides and max_side"},
        {MIN, "data.val.transform={crop: keep_ratio, short_sides: [8, 9], max_side: 9}",
         KPL_EINVAL, "data.val.transform.short_sides: evaluation resizes every image the same "
                     "way: one value, not 2"},
        {MIN, "data.train.transform.max_side=1333", KPL_EINVAL,
         "data.train.transform.max_side: only used with data.train.transform.crop keep_ratio "
         "(crop is none)"},
        {MIN, "data.val.transform.mask_pad=255", KPL_EINVAL,
         "data.val.transform.mask_pad: only used with data.val.transform.crop keep_ratio"},
        {MIN, "data.train.transform.short_sides=[1, 2, 3, 4, 5, 6, 7, 8, 9]", KPL_EINVAL,
         "data.train.transform.short_sides: more than 8 values"},
        {MIN, "data.train.transform.mask_pad=256", KPL_ERANGE,
         "data.train.transform.mask_pad: 256 is out of range"},
        {MIN, "data.train.transform.short_sides=[800, -1]", KPL_ERANGE,
         "data.train.transform.short_sides: -1 is out of range"},
    };
    check_cases(cases, sizeof cases / sizeof cases[0]);
}

/* scale_crop's keys (segmentation) bind into the transform; mask_pad is
 * its too; keep_ratio's short side 0 is the stored size. */
static void test_scale_crop_keys(void **state)
{
    (void)state;
    const char *seg = "epochs: 3\nmodel: {name: cnn, num_classes: 10}\noptimizer: {lr: 0.1}\n"
                      "data:\n  train:\n    path: train\n    batch_size: 2\n"
                      "    mask_feature: mask\n    transform:\n"
                      "      crop: scale_crop\n      size: [512, 1024]\n"
                      "      scale_range: [0.5, 2.0]\n      resize_shorter: 1024\n"
                      "      cat_max_ratio: 0.75\n      mask_pad: 255\n"
                      "  val: {path: val, mask_feature: mask, transform: {crop: keep_ratio, "
                      "short_sides: 0, max_side: 2048, mask_pad: 255}}\n";
    OK(kpl_recipe_load_string(seg, "seg", 0, NULL, &R));
    const kpl_transform_config *t = &R.data.train.loader.transform, *v = &R.data.val.loader.transform;
    assert_int_equal(t->crop, KPL_CROP_SCALE_CROP);
    assert_int_equal(t->out_h, 512);
    assert_int_equal(t->out_w, 1024);
    assert_true(t->scale_range[0] == 0.5f && t->scale_range[1] == 2.0f);
    assert_true(t->cat_max_ratio == 0.75f);
    assert_int_equal(t->resize_shorter, 1024);
    assert_int_equal(t->mask_pad, 255);
    assert_string_equal(R.data.train.mask_feature, "mask");
    assert_int_equal(v->crop, KPL_CROP_KEEP_RATIO);
    assert_int_equal(v->num_short_sides, 1);
    assert_int_equal(v->short_sides[0], 0);
    assert_int_equal(v->mask_pad, 255);
    OK(kpl_recipe_load_string(MIN, "min", 0, NULL, &R));
    assert_true(R.data.train.loader.transform.scale_range[0] == 0.5f &&
                R.data.train.loader.transform.scale_range[1] == 2.0f);
    assert_true(R.data.train.loader.transform.cat_max_ratio == 0.0f);

    static const recipe_case cases[] = {
        {MIN, "data.train.transform.scale_range=[0.75, 1.5]", KPL_EINVAL,
         "data.train.transform.scale_range: only used with data.train.transform.crop scale_crop "
         "(crop is none)"},
        {MIN, "data.val.transform={crop: keep_ratio, short_sides: 0, max_side: 9, "
              "cat_max_ratio: 0.75}", KPL_EINVAL,
         "data.val.transform.cat_max_ratio: only used with data.val.transform.crop scale_crop "
         "(crop is keep_ratio)"},
        {MIN, "data.train.transform={crop: scale_crop}", KPL_EINVAL,
         "data.train.transform.size: crop 'scale_crop' needs an output size"},
        {MIN, "data.train.transform={crop: scale_crop, size: 8, scale_range: [0.5, 17]}",
         KPL_ERANGE, "data.train.transform.scale_range: 17 is out of range"},
        {MIN, "data.train.transform={crop: scale_crop, size: 8, cat_max_ratio: 1.5}",
         KPL_ERANGE, "data.train.transform.cat_max_ratio: 1.5 is out of range"},
        {MIN, "data.train.transform={crop: scale_crop, size: 8, max_side: 9}", KPL_EINVAL,
         "data.train.transform.max_side: only used with data.train.transform.crop keep_ratio "
         "(crop is scale_crop)"},
    };
    check_cases(cases, sizeof cases / sizeof cases[0]);
}

/* Every recipe of the project loads (its bases too). */
static void test_project_recipes(void **state)
{
    (void)state;
    static const char *const files[] = {"fashion_mnist/cnn.yaml", "fashion_mnist/lenet.yaml",
                                        "fashion_mnist/resnet18.yaml", "imagenet/resnet50.yaml"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/recipes/%s", KPL_SOURCE_DIR, files[i]);
        OK(kpl_recipe_load(path, 0, NULL, &R));
        assert_true(R.epochs >= 1);
    }
}

/* Damaged recipes: every prefix and byte-flipped copies of a real one
 * must load or fail with a message, never crash (ASan watches). */
static void test_fuzz(void **state)
{
    (void)state;
    char path[1024];
    snprintf(path, sizeof path, "%s/recipes/fashion_mnist/cnn.yaml", KPL_SOURCE_DIR);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    char text[8192];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    char buf[8192];
    int ok = 0, bad = 0;
    for (size_t cut = 0; cut <= n; cut += 7) {
        memcpy(buf, text, cut);
        buf[cut] = 0;
        if (kpl_recipe_load_string(buf, "cut", 0, NULL, &R) == KPL_OK) ok++;
        else bad++, assert_true(strlen(kpl_last_error()) > 0);
    }
    static const char flips[] = ":-[]{}&*!|>'\"#%@ \n\t\x01\xff";
    uint32_t x = 12345;
    for (int k = 0; k < 3000; k++) {
        memcpy(buf, text, n + 1);
        for (int j = 0; j < 3; j++) {
            x = x * 1103515245u + 12345u;
            size_t at = (x >> 8) % n;
            x = x * 1103515245u + 12345u;
            buf[at] = flips[(x >> 8) % (sizeof flips - 1)];
        }
        if (kpl_recipe_load_string(buf, "flip", 0, NULL, &R) == KPL_OK) ok++;
        else bad++, assert_true(strlen(kpl_last_error()) > 0);
    }
    assert_true(ok > 0 && bad > 0);
}

static void test_keys(void **state)
{
    (void)state;
    char path[128];
    snprintf(path, sizeof path, "%s/keys.txt", dir);
    FILE *f = fopen(path, "w+");
    kpl_recipe_print_keys(f);
    rewind(f);
    char text[65536];
    size_t n = fread(text, 1, sizeof text - 1, f);
    text[n] = 0;
    fclose(f);
    assert_non_null(strstr(text, "epochs: REQUIRED  # epochs to train\n"));
    assert_non_null(strstr(text, "  name: sgd  # the update rule (a plugin may add others) [sgd|adam|adamw|lars]\n"));
    assert_non_null(strstr(text, "    transform:\n      channels: 3"));
}

int main(void)
{
    snprintf(dir, sizeof dir, "/tmp/kpl-recipe-XXXXXX");
    if (!mkdtemp(dir)) return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults), cmocka_unit_test(test_overrides),
        cmocka_unit_test(test_base),     cmocka_unit_test(test_errors),
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_groups), cmocka_unit_test(test_project_recipes),
        cmocka_unit_test(test_fuzz),     cmocka_unit_test(test_keys),
        cmocka_unit_test(test_override_merge), cmocka_unit_test(test_not_regular),
        cmocka_unit_test(test_long_values), cmocka_unit_test(test_task),
        cmocka_unit_test(test_keep_ratio_keys),
        cmocka_unit_test(test_scale_crop_keys), cmocka_unit_test(test_profile_steps),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) rc = rc ? rc : 1;
    return rc;
}
