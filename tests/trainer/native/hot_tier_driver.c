/* Drives trainer/native/hot_tier.c under AddressSanitizer and UndefinedBehaviorSanitizer
 * (tests/trainer/test_native_tier_sanitized.py compiles it with the source included): 3,000 batches of 1,024
 * Zipf ids through a planner of 3,000 slots, checking after each that the table holds exactly the rows in use,
 * each at its slot; then the map's set, remove, lookup and rehash. Prints "ok ..." and exits 0, or says what
 * broke and exits 1. Compile with -DHOT_TIER_SOURCE='"path/to/hot_tier.c"'. */
#include HOT_TIER_SOURCE
#include <stdio.h>
#include <stdlib.h>

enum { HOT = 3000, CAPACITY = 8192, COUNT = 1024, BATCHES = 3000, MAP_ROWS = 500, MAP_CAPACITY = 1024 };

static int64_t table[CAPACITY][2], slot_records[HOT][SLOT_FIELDS];
static int64_t ids[COUNT], scratch[4 * COUNT], out[7 * COUNT];
static int64_t map[MAP_CAPACITY][2], bigger[2 * MAP_CAPACITY][2];

int main(void) {
    for (int64_t at = 0; at < CAPACITY; at++) table[at][0] = table[at][1] = EMPTY;
    for (int64_t slot = 0; slot < HOT; slot++) {
        slot_records[slot][ROW] = slot_records[slot][OLDER] = slot_records[slot][NEWER] = EMPTY;
        slot_records[slot][DIRTY] = 0;
    }
    int64_t scalars[3] = {EMPTY, EMPTY, 0}, counts[3];
    uint64_t state = 3;
    long loads = 0, write_backs = 0;
    for (int batch = 0; batch < BATCHES; batch++) {
        for (int k = 0; k < COUNT; k++) {
            state = state * 6364136223846793005ULL + 1442695040888963407ULL;
            double u = ((state >> 11) + 1.0) / 9007199254740993.0;
            ids[k] = ((int64_t)(1.0 / (u * u)) % 1000003 * 7919) % 200000;
        }
        int64_t status = ctr_plan(HOT, CAPACITY, table, slot_records, scalars, ids, COUNT, batch % 5 != 0, scratch,
                                  out, counts);
        if (status != 0) {
            printf("ctr_plan returned %ld at batch %d\n", (long)status, batch);
            return 1;
        }
        loads += counts[1];
        write_backs += counts[2];
        int64_t held = 0;
        for (int64_t at = 0; at < CAPACITY; at++) {
            if (table[at][0] == EMPTY) continue;
            held++;
            if (slot_records[table[at][1]][ROW] != table[at][0]) {
                printf("batch %d: the table says row %ld is in slot %ld, which holds row %ld\n", batch,
                       (long)table[at][0], (long)table[at][1], (long)slot_records[table[at][1]][ROW]);
                return 1;
            }
        }
        if (held != scalars[2]) {
            printf("batch %d: the table holds %ld rows, %ld slots are in use\n", batch, (long)held, (long)scalars[2]);
            return 1;
        }
    }
    int64_t rows[MAP_ROWS], values[MAP_ROWS], found[MAP_ROWS];
    for (int k = 0; k < MAP_ROWS; k++) rows[k] = (int64_t)k * 37, values[k] = k;
    for (int64_t at = 0; at < MAP_CAPACITY; at++) map[at][0] = EMPTY;
    for (int64_t at = 0; at < 2 * MAP_CAPACITY; at++) bigger[at][0] = EMPTY;
    ctr_map_set(map, MAP_CAPACITY, rows, values, MAP_ROWS);
    int64_t removed = ctr_map_remove(map, MAP_CAPACITY, rows, MAP_ROWS / 2);
    ctr_map_rehash((const int64_t (*)[2])map, MAP_CAPACITY, bigger, 2 * MAP_CAPACITY);
    int64_t present = ctr_map_lookup((const int64_t (*)[2])bigger, 2 * MAP_CAPACITY, rows, MAP_ROWS, found);
    if (removed != MAP_ROWS / 2 || present != MAP_ROWS - MAP_ROWS / 2 || found[0] != EMPTY ||
        found[MAP_ROWS - 1] != MAP_ROWS - 1) {
        printf("the map: removed %ld, present %ld, found %ld and %ld\n", (long)removed, (long)present,
               (long)found[0], (long)found[MAP_ROWS - 1]);
        return 1;
    }
    printf("ok: %d batches, %ld loads, %ld write-backs\n", BATCHES, loads, write_backs);
    return 0;
}
