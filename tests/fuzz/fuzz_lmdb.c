/*
 * fuzz_lmdb.c — the Caffe Datum parser of dataio/convert_lmdb.c, reached
 * through kpl_convert_lmdb: the input's parts become the values of a fresh
 * LMDB database, which is converted to a KPLRecord dataset in the scratch
 * directory (and that dataset is then read back whole).
 *
 * Input: up to four serialized Datums separated by "@KPL@", stored under
 * the keys "k0".."k3" (LMDB keeps them in that order).  A Datum is the
 * protobuf of caffe.proto: channels = 1, height = 2, width = 3 (varint),
 * data = 4 (bytes), label = 5 (varint), float_data = 6 (packed, or
 * fixed32 one by one), encoded = 7 (varint).
 * Seeds (corpus/lmdb) are raw and encoded Datums as Caffe writes them.
 *
 * parse_datum is static: a kpl__ declaration in dataio_impl.h would let a
 * harness call it without the database (see docs/fuzzing.md).
 */
#include "fuzz_common.h"

#include <lmdb.h>

#include "dataio.h"

#define SEP "@KPL@"
#define MAX_VALUES 4

static bool write_db(const char *path, fuzz_part *v, int n)
{
    MDB_env *env = NULL;
    MDB_txn *txn = NULL;
    MDB_dbi dbi;
    bool ok = mdb_env_create(&env) == 0 && mdb_env_set_mapsize(env, (size_t)1 << 20) == 0 &&
              mdb_env_open(env, path, MDB_NOSUBDIR | MDB_NOLOCK | MDB_NOSYNC, 0600) == 0 &&
              mdb_txn_begin(env, NULL, 0, &txn) == 0 && mdb_dbi_open(txn, NULL, 0, &dbi) == 0;
    for (int i = 0; ok && i < n; i++) {
        char key[8];
        snprintf(key, sizeof key, "k%d", i);
        MDB_val k = {strlen(key), key}, d = {v[i].n, (void *)v[i].p};
        ok = mdb_put(txn, dbi, &k, &d, 0) == 0;
    }
    if (ok) {
        ok = mdb_txn_commit(txn) == 0;
        txn = NULL;
    }
    if (txn) mdb_txn_abort(txn);
    if (env) mdb_env_close(env);
    return ok;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_reset();
    const char *root = fuzz_dir("lmdb");
    char db[PATH_MAX], lock[PATH_MAX], out[PATH_MAX];
    fuzz_path(db, root, "db.mdb");
    fuzz_path(lock, root, "db.mdb-lock");
    fuzz_path(out, root, "out");
    unlink(db);
    unlink(lock);
    fuzz_rm_tree(out);

    fuzz_part v[MAX_VALUES];
    int n = fuzz_split(data, size, SEP, strlen(SEP), v, MAX_VALUES);
    if (!write_db(db, v, n)) return 0; /* LMDB's own limits, not kpl's */
    kpl_convert_options opt = KPL_CONVERT_OPTIONS_INIT;
    opt.writer.zstd_level = 0;
    int64_t count = 0;
    if (fuzz_st(kpl_convert_lmdb(db, out, &opt, &count), "convert") == KPL_OK) {
        if (count != n) abort(); /* every value is an example */
        kpl_verify_stats vs;
        if (kpl_dataset_verify(out, &vs, NULL, NULL) != KPL_OK) {
            fprintf(stderr, "fuzz_lmdb: the converted dataset does not verify: %s\n",
                    kpl_last_error());
            abort();
        }
    }
    fuzz_rm_tree(out);
    unlink(db);
    return 0;
}
