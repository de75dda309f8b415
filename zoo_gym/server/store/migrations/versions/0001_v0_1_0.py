"""v0.1.0: the round inputs table, the schema the tag v0.1.0's `gym-server init` wrote

Revision ID: 0001
Revises: 0000
Create Date: 2026-11-23

RoundInputs (what a round's outcome depends on besides its submissions, recorded when it closes). A database
made by v0.1.0 has the tables of 0000 and this one, and no alembic_version table; zoo_gym.server.store.migrations
reads it as this revision. Rounds closed before it have no row: publishing records one when it needs it.
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: Union[str, Sequence[str], None] = "0000"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table('roundinputs',
    sa.Column('round_id', sa.Integer(), nullable=False),
    sa.Column('reputations_json', sa.String(), nullable=False),
    sa.Column('dp_clip', sa.Float(), nullable=True),
    sa.Column('population', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('round_id')
    )


def downgrade() -> None:
    op.drop_table('roundinputs')
