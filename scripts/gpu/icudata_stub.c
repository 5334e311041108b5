/* icudata_stub.c — a stand-in for ICU's data library in the GPU kit.
 *
 * libkpl links libxml2 (Pascal VOC annotations), which links ICU's
 * libicuuc, which links libicudata: 31 MB of locale and conversion tables
 * (9 MB of the kit compressed) that nothing the kit runs ever reads, since
 * ICU opens its data only when libxml2 meets a document in an encoding it
 * does not know itself.  This library has the same name and exports the one
 * symbol libicuuc takes from it (icudtNN_dat, NN the ICU major version,
 * given as ICU_DATA_SYMBOL) holding a valid ICU common-data package with no
 * entries: were ICU to look something up, it would find nothing and say so
 * (U_MISSING_RESOURCE_ERROR), never read past the table.
 *
 *   cc -shared -fPIC -DICU_DATA_SYMBOL=icudt72_dat -Wl,-soname,libicudata.so.72 \
 *      -o libicudata.so.72 icudata_stub.c
 *
 * The layout is ICU's (udata.h's DataHeader and UDataInfo, then the table
 * of contents of a "CmnD" package, format 1): a 32-byte header, then the
 * entry count, here 0.  scripts/gpu/pack.sh builds it; its --check says
 * which library of the kit is this stand-in.
 */
#include <stdint.h>

#ifndef ICU_DATA_SYMBOL
#error "define ICU_DATA_SYMBOL, e.g. -DICU_DATA_SYMBOL=icudt72_dat"
#endif

struct icu_common_data {
    uint16_t header_size; /* bytes before the table of contents */
    uint8_t magic1, magic2;
    uint16_t info_size; /* UDataInfo */
    uint16_t reserved_word;
    uint8_t is_big_endian, charset_family, sizeof_uchar, reserved_byte;
    uint8_t data_format[4];
    uint8_t format_version[4];
    uint8_t data_version[4];
    uint8_t pad[8]; /* the header is padded to 16 bytes */
    uint32_t count; /* entries of the table of contents */
    uint32_t unused[3];
};

__attribute__((visibility("default"), aligned(16)))
const struct icu_common_data ICU_DATA_SYMBOL = {
    .header_size = 32,
    .magic1 = 0xda,
    .magic2 = 0x27,
    .info_size = 20,
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    .is_big_endian = 1,
#endif
    .charset_family = 0, /* ASCII */
    .sizeof_uchar = 2,
    .data_format = {'C', 'm', 'n', 'D'},
    .format_version = {1, 0, 0, 0},
    .count = 0,
};
